"""Unit tests judged outside the program under test: the sandbox runs expressions, this module decides.

What: `plan_tests(source)` turns test source into steps for the sandboxed runner — statements to execute and
*probes* (expressions whose values the runner sends back) — and keeps, on this side, what each assert
expects. `judge(plan, lines)` compares the returned values with the expectations and gives the verdict.
Why: when tests ran in the program's own process, an object whose `__eq__` always returns True passed
`assert add(2, 2) == 5`, and a program that read the verdict's nonce from memory (gc) forged a pass. Now:
- the runner sends values as plain data only (int, float, bool, str, bytes, None and lists, tuples, dicts,
  sets of them: exact types, no subclasses); anything else fails the test with reason `bad_result_type`;
- the comparison happens here, in the reward worker, on plain values;
- the expected side of `assert EXPR OP LITERAL` (a literal, `ast.literal_eval`) never enters the sandbox, so
  the program cannot read it from memory and answer it; a line the program forges can only claim a value.
Contract of the tests (docs/rewards.md): top-level statements run in order; a top-level `assert` is one test:
`assert A OP B [OP C ...]` (==, !=, <, <=, >, >=, in, not in, is None ...) compares plain values, and
`assert EXPR` passes when the plain value of EXPR is truthy.

Run: pytest tests/unit/rewards/test_sandbox_hostile.py -q
"""
from __future__ import annotations

import ast
import operator
from dataclasses import dataclass, field

OPS = {ast.Eq: operator.eq, ast.NotEq: operator.ne, ast.Lt: operator.lt, ast.LtE: operator.le, ast.Gt: operator.gt,
       ast.GtE: operator.ge, ast.In: lambda a, b: a in b, ast.NotIn: lambda a, b: a not in b,
       ast.Is: lambda a, b: a is b if b is None or a is None else a == b,  # identity only means something for None
       ast.IsNot: lambda a, b: a is not b if b is None or a is None else a != b}
_MISSING = object()


@dataclass
class Check:
    """One assert: operand i is either a literal kept here or probe expression sent to the runner."""

    line: int
    ops: list  # ast comparison op classes; empty for a bare `assert EXPR`
    literals: dict[int, object]  # operand index -> expected value (never sent)
    probes: list[int]  # operand indexes the runner evaluates, in order
    message: str = ""


@dataclass
class Plan:
    steps: list[dict] = field(default_factory=list)  # what the runner gets
    checks: dict[int, Check] = field(default_factory=dict)  # probe id -> check, kept here


def _literal(node: ast.AST):
    try:
        return ast.literal_eval(node)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return _MISSING


def plan_tests(source: str) -> Plan:
    """Steps for the runner and the checks kept here. ValueError when the tests do not parse."""
    try:
        body = ast.parse(source, "tests.py").body
    except SyntaxError as exc:
        raise ValueError(f"the unit tests do not parse (line {exc.lineno}: {exc.msg}); fix the reference") from None
    plan = Plan()
    for node in body:
        if not isinstance(node, ast.Assert):
            plan.steps.append({"kind": "exec", "src": ast.unparse(node), "line": node.lineno})
            continue
        test = node.test
        operands = [test.left, *test.comparators] if isinstance(test, ast.Compare) else [test]
        ops = [type(op) for op in test.ops] if isinstance(test, ast.Compare) else []
        literals = {i: v for i, n in enumerate(operands) if ops and (v := _literal(n)) is not _MISSING}
        probes = [i for i in range(len(operands)) if i not in literals]
        message = _literal(node.msg) if node.msg is not None else ""
        check_id = len(plan.checks)
        plan.checks[check_id] = Check(node.lineno, ops, literals, probes,
                                      message if isinstance(message, str) else "")
        plan.steps.append({"kind": "probe", "id": check_id, "line": node.lineno,
                           "exprs": [ast.unparse(operands[i]) for i in probes]})
    return plan


def decode_value(v, depth: int = 0):
    """The runner's encoding of a plain value back into Python (sandbox_boot.encode_value is the inverse)."""
    if depth > 20 or not isinstance(v, dict) or len(v) != 1:
        raise ValueError("malformed value")
    (tag, x), = v.items()
    if tag in ("i", "s", "b") and type(x) is {"i": int, "s": str, "b": bool}[tag]:
        return x
    if tag == "f" and isinstance(x, (int, float, str)):
        return float(x)  # str for "nan", "inf", "-inf"
    if tag == "n":
        return None
    if tag == "y" and isinstance(x, str):
        return bytes.fromhex(x)
    if tag in ("l", "t", "set") and isinstance(x, list):
        items = [decode_value(i, depth + 1) for i in x]
        return items if tag == "l" else (tuple(items) if tag == "t" else set(items))
    if tag == "d" and isinstance(x, list):
        return {decode_value(k, depth + 1): decode_value(val, depth + 1) for k, val in x}
    raise ValueError(f"unknown value tag {tag!r}")


def _verdict(check: Check, values: list) -> bool:
    operands = [check.literals[i] if i in check.literals else values[check.probes.index(i)]
                for i in range(len(check.probes) + len(check.literals))]
    if not check.ops:
        return bool(operands[0])
    return all(OPS[op](a, b) for op, a, b in zip(check.ops, operands, operands[1:]))


def judge(plan: Plan, lines: list[dict]) -> dict:
    """Verdict from the runner's lines: {"reason", "passed", "total", "failures", "exc"} (reason "" = the
    runner stopped before the end: the caller explains why from how the process ended)."""
    by_id: dict[int, dict] = {}
    stopped = None
    for line in lines:
        if line.get("kind") == "probe" and isinstance(line.get("id"), int) and line["id"] not in by_id:
            by_id[line["id"]] = line
        elif line.get("kind") == "stopped" and stopped is None:
            stopped = line
    total, passed, failures = len(plan.checks), 0, []
    for check_id, check in plan.checks.items():
        got = by_id.get(check_id)
        if got is None:
            break  # the runner never got here
        reason, exc = _judge_one(check, got)
        if reason is None:
            passed += 1
            continue
        failures.append({"line": check.line, "reason": reason, "exc": exc})
        if reason != "tests_failed":
            break
    finished = len(by_id) == total and stopped is None
    if failures:
        reason = failures[0]["reason"]
    elif stopped is not None:
        reason = str(stopped.get("reason") or "error")
        failures.append({"line": stopped.get("line", 0), "reason": reason, "exc": str(stopped.get("exc", ""))[:500]})
    elif not finished:
        reason = ""
    else:
        reason = "passed" if total else "no_tests"
    return {"reason": reason, "passed": passed, "total": total, "failures": failures[:5],
            "exc": failures[0]["exc"] if failures else ""}


def _judge_one(check: Check, got: dict) -> tuple[str | None, str]:
    if "error" in got:
        reason = got.get("reason") if got.get("reason") in RUNNER_REASONS else "error"
        return reason, str(got["error"])[:500]
    try:
        values = [decode_value(v) for v in got.get("values", [])]
        if len(values) != len(check.probes):
            raise ValueError("wrong number of values")
    except (ValueError, TypeError, OverflowError, RecursionError) as exc:
        return "bad_result_type", f"unreadable value from the sandbox ({exc})"
    try:
        ok = _verdict(check, values)
    except (TypeError, ValueError, ArithmeticError) as exc:  # e.g. 3 < "a": a failed test, not a crash
        return "tests_failed", f"line {check.line}: {type(exc).__name__}: {exc}"
    if ok:
        return None, ""
    shown = ", ".join(repr(v)[:80] for v in values)
    return "tests_failed", f"AssertionError: line {check.line}: got {shown}" + (
        f" ({check.message})" if check.message else "")


# reasons a runner may report for a probe that raised; anything else is reported as "error"
RUNNER_REASONS = {"error", "memory_limit", "process_limit", "network_blocked", "write_blocked", "syscall_blocked",
                  "bad_result_type", "tests_failed"}
