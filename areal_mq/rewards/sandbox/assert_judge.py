"""Unit tests judged outside the program under test: the sandbox evaluates program calls, this module decides.

What: `plan_tests(tests, program)` splits test source into what the sandboxed runner must do — setup
statements and *parts* (the program-facing sub-expressions of each assert, whose values it sends back as
plain data) — and what stays here: the rest of every assert and the setup that needs no program. `judge(plan,
lines)` rebuilds each assert from the returned values and computes the verdict in the reward worker.
Why: when tests ran in the program's own process, an object whose `__eq__` always returns True passed
`assert add(2, 2) == 5`, and a program that read the nonce from memory (gc) forged a pass. A program can
still find the status pipe and write lines that look like the runner's, so what a line may carry is limited
to what the program controls anyway: the values of its own functions, objects and names. Expected values,
comparisons and the test's own arithmetic never enter the sandbox.

Contract (also in docs/rewards.md). Top-level statements run in order; each top-level `assert` is one test.
- In an assert, the reward worker evaluates literals, comparisons (`==`, `<`, `in`, `is` ...), `and`/`or`/
  `not`, arithmetic, containers, f-strings, lambdas and comprehensions that use no program name, and calls of
  trusted functions: the builtins of SAFE_BUILTINS, `math`, and names the tests set from those alone.
- The sandbox evaluates every *part*: a name the program or a setup statement defines, a call of one (with
  its arguments), an attribute, method call or subscript of a program value, a call of any other builtin
  (`isinstance`, `getattr`, `print` ...), a lambda or comprehension that uses a program name. Parts are
  evaluated left to right, all of them (also where Python would short-circuit); a part that raised fails
  the test only if the verdict needs it.
- A part's value must be plain data: exactly int, float, bool, str, bytes, None, or list, tuple, dict, set,
  frozenset of them (no subclasses, no dict views or generators); anything else is `bad_result_type`.
- Setup statements of the form `NAME = EXPR` (or `A, B = EXPR`) whose EXPR uses no program name, and that
  no part or sandboxed statement reads, run here only: `expected = [1, 4, 9]` never enters the sandbox. Every
  other setup statement (imports, defs, calls, assignments from program values) runs in the sandbox.
What a hostile program can do is choose the values of its parts — as if its functions returned them.
So keep expected values out of parts: `assert [sq(i) for i in range(3)] == [0, 1, 4]`, not
`assert all(sq(i) == i * i for i in range(3))` (one part, which the program could claim is True), and do not
hide the comparison in a helper the tests define (`def check(f): assert f(2) == 4` runs in the sandbox;
asserts inside functions are not tests).

Run: pytest tests/unit/rewards/test_sandbox_hostile.py tests/unit/rewards/test_sandbox_judge.py -q
"""
from __future__ import annotations

import ast
import builtins
import math
from dataclasses import dataclass, field

SAFE_BUILTINS = ("abs", "all", "any", "bin", "bool", "bytes", "chr", "dict", "divmod", "enumerate", "filter",
                 "float", "frozenset", "hex", "int", "len", "list", "map", "max", "min", "oct", "ord", "pow",
                 "range", "repr", "reversed", "round", "set", "slice", "sorted", "str", "sum", "tuple", "zip")
TRUSTED_MODULES = {"math": math}
LEAF = "__sbx_part__"  # outside: LEAF(i) is the value of part i
# scope-free expression nodes split into parts and evaluated here; any other tainted node is one part
_SPLIT = (ast.BinOp, ast.UnaryOp, ast.BoolOp, ast.Compare, ast.IfExp, ast.Tuple, ast.List, ast.Set, ast.Dict,
          ast.JoinedStr, ast.FormattedValue, ast.Starred)


@dataclass
class Check:
    """One top-level assert: `expr` (compiled, evaluated here) with LEAF(i) in place of part i."""

    line: int
    expr: object  # code object
    parts: list[str]  # sources the runner evaluates, in order
    message: str = ""


@dataclass
class Plan:
    steps: list[dict] = field(default_factory=list)  # what the runner gets, in order
    actions: list[tuple] = field(default_factory=list)  # ("bind", code, line) | ("check", id, line), in order
    checks: dict[int, Check] = field(default_factory=dict)  # probe id -> check, kept here


def reads(node: ast.AST, bound: frozenset = frozenset()) -> set[str]:
    """Names an expression or statement reads (or binds, for walrus) that it does not bind in its own scope."""
    if isinstance(node, ast.Name):
        return set() if node.id in bound else {node.id}
    if isinstance(node, ast.Lambda):
        a = node.args
        params = {x.arg for x in a.posonlyargs + a.args + a.kwonlyargs} | {x.arg for x in (a.vararg, a.kwarg) if x}
        out = set().union(*(reads(d, bound) for d in a.defaults + [d for d in a.kw_defaults if d]))
        return out | reads(node.body, bound | params)
    if isinstance(node, (ast.ListComp, ast.SetComp, ast.GeneratorExp, ast.DictComp)):
        out, inner = set(), set(bound)
        for gen in node.generators:
            out |= reads(gen.iter, frozenset(inner))
            inner |= {n.id for n in ast.walk(gen.target) if isinstance(n, ast.Name)}
            for cond in gen.ifs:
                out |= reads(cond, frozenset(inner))
        for elt in ([node.key, node.value] if isinstance(node, ast.DictComp) else [node.elt]):
            out |= reads(elt, frozenset(inner))
        return out
    return set().union(*(reads(c, bound) for c in ast.iter_child_nodes(node)))


def binds(stmt: ast.AST) -> set[str]:
    """Names a top-level statement binds (not those local to a function or class body it defines)."""
    out: set[str] = set()
    todo = [stmt]
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(node.name)
            out |= {n for sub in ast.walk(node) if isinstance(sub, ast.Global) for n in sub.names}
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            out |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            out.add(node.id)
        todo.extend(ast.iter_child_nodes(node))
    return out


def rebinds(stmt: ast.stmt) -> set[str]:
    """Names a statement binds to something else than what the judge has under that name (`import math`
    binds the same math)."""
    if isinstance(stmt, ast.ImportFrom) and any(a.name == "*" for a in stmt.names):
        return set(SAFE_BUILTINS) | set(TRUSTED_MODULES)
    if isinstance(stmt, ast.Import):
        return {(a.asname or a.name).split(".")[0] for a in stmt.names
                if a.asname not in (None, a.name) or a.name not in TRUSTED_MODULES}
    return binds(stmt)


def _shadowed(program: str) -> set[str]:
    """Trusted names the program rebinds at module level (its own `sum` is what the tests then call)."""
    try:
        body = ast.parse(program).body
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return set()
    return set().union(*(rebinds(stmt) for stmt in body))


class _Splitter:
    """Replaces every part (a program-facing sub-expression) of an assert by LEAF(i)."""

    def __init__(self, trusted: set[str]):
        self.trusted, self.parts = trusted, []

    def split(self, node: ast.expr) -> ast.expr:
        if not reads(node) - self.trusted:
            return node
        if isinstance(node, ast.Call) and not reads(node.func) - self.trusted:
            source, first = ast.unparse(node), len(self.parts)
            node.args = [self.split(a) for a in node.args]
            for kw in node.keywords:
                kw.value = self.split(kw.value)
            args = node.args + [kw.value for kw in node.keywords]
            if self._is_builtin(node.func) and all(self._is_part(a) for a in args):
                del self.parts[first:]  # len(x), list(gen()): no test data joins the program's values, so the
                return self._part(source)  # sandbox may apply the builtin (and x need not be plain data)
            return node
        if isinstance(node, _SPLIT):
            for name, value in ast.iter_fields(node):
                if isinstance(value, ast.expr):
                    setattr(node, name, self.split(value))
                elif isinstance(value, list):
                    setattr(node, name, [self.split(v) if isinstance(v, ast.expr) else v for v in value])
            return node
        return self._part(ast.unparse(node))

    def _part(self, source: str) -> ast.expr:
        self.parts.append(source)
        return ast.Call(ast.Name(LEAF, ast.Load()), [ast.Constant(len(self.parts) - 1)], [])

    def _is_builtin(self, func: ast.expr) -> bool:
        """A trusted builtin or math function (not a lambda or helper the tests wrote: those hold test data)."""
        if isinstance(func, ast.Name):
            return func.id in SAFE_BUILTINS and func.id in self.trusted
        return isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and \
            func.value.id in TRUSTED_MODULES and func.value.id in self.trusted

    @staticmethod
    def _is_part(node: ast.expr) -> bool:
        return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == LEAF


def _outside_candidate(stmt: ast.stmt) -> set[str] | None:
    """Target names of `NAME = EXPR` / `A, B = EXPR`, or None for any other statement."""
    if not isinstance(stmt, ast.Assign):
        return None
    names = set()
    for target in stmt.targets:
        elts = target.elts if isinstance(target, (ast.Tuple, ast.List)) else [target]
        if not all(isinstance(e, ast.Name) for e in elts):
            return None
        names |= {e.id for e in elts}
    return names


def _classify(body: list[ast.stmt], base: set[str]) -> tuple[list[bool], set[str]]:
    """Which setup statements run here (True) and the trusted names, as a fixed point: a statement runs here
    when its value uses only trusted names and nothing in the sandbox reads or rebinds what it sets."""
    outside = [_outside_candidate(s) is not None for s in body]
    while True:
        names = set().union(*(_outside_candidate(s) for s, o in zip(body, outside) if o))
        setup = [s for s, o in zip(body, outside) if not o and not isinstance(s, ast.Assert)]
        sandbox_binds = set().union(*(rebinds(s) for s in setup))
        trusted = (base - sandbox_binds) | names
        sandbox_reads = set().union(*(reads(s) for s in setup))
        for stmt in body:
            if isinstance(stmt, ast.Assert):
                splitter = _Splitter(trusted)
                splitter.split(_copy(stmt.test))
                sandbox_reads |= set().union(*(reads(ast.parse(p, mode="eval")) for p in splitter.parts))
        changed = False
        for i, (stmt, here) in enumerate(zip(body, outside)):
            if here and (reads(stmt.value) - trusted or _outside_candidate(stmt) & (sandbox_reads | sandbox_binds)):
                outside[i], changed = False, True
        if not changed:
            return outside, trusted


def _copy(node):
    return ast.parse(ast.unparse(node), mode="eval").body


def plan_tests(source: str, program: str = "") -> Plan:
    """Steps for the runner and the checks kept here. ValueError when the tests do not parse."""
    try:
        body = ast.parse(source, "tests.py").body
    except SyntaxError as exc:
        raise ValueError(f"the unit tests do not parse (line {exc.lineno}: {exc.msg}); fix the reference") from None
    base = (set(SAFE_BUILTINS) | set(TRUSTED_MODULES)) - _shadowed(program)
    outside, trusted = _classify(body, base)
    plan = Plan()
    for stmt, here in zip(body, outside):
        if here:
            plan.actions.append(("bind", compile(ast.Module([stmt], []), "tests.py", "exec"), stmt.lineno))
        elif not isinstance(stmt, ast.Assert):
            plan.steps.append({"kind": "exec", "src": ast.unparse(stmt), "line": stmt.lineno})
        else:
            splitter = _Splitter(trusted)
            expr = ast.fix_missing_locations(ast.Expression(splitter.split(_copy(stmt.test))))
            msg = stmt.msg.value if isinstance(stmt.msg, ast.Constant) and isinstance(stmt.msg.value, str) else ""
            check_id = len(plan.checks)
            plan.checks[check_id] = Check(stmt.lineno, compile(expr, "tests.py", "eval"), splitter.parts, msg)
            plan.actions.append(("check", check_id, stmt.lineno))
            plan.steps.append({"kind": "probe", "id": check_id, "line": stmt.lineno, "exprs": splitter.parts})
    return plan


def decode_value(v, depth: int = 0):
    """The runner's encoding of a plain value back into Python (sandbox_boot.encode_value is the inverse)."""
    if depth > 20 or not isinstance(v, dict) or len(v) != 1:
        raise ValueError("malformed value")
    (tag, x), = v.items()
    if tag in ("i", "s", "b") and type(x) is {"i": int, "s": str, "b": bool}[tag]:
        return x
    if tag == "x" and isinstance(x, str) and len(x) < 200_000:
        return int(x, 16)  # a big int as hex: no decimal digit limit on this side
    if tag == "f" and isinstance(x, (int, float, str)):
        return float(x)  # str for "nan", "inf", "-inf"
    if tag == "n":
        return None
    if tag == "y" and isinstance(x, str):
        return bytes.fromhex(x)
    if tag in ("l", "t", "set", "fset") and isinstance(x, list):
        items = [decode_value(i, depth + 1) for i in x]
        return {"l": list, "t": tuple, "set": set, "fset": frozenset}[tag](items)
    if tag == "d" and isinstance(x, list):
        return {decode_value(k, depth + 1): decode_value(val, depth + 1) for k, val in x}
    raise ValueError(f"unknown value tag {tag!r}")


class PartFailed(Exception):
    """A part the verdict needs raised in the sandbox (or its value was not plain data)."""

    def __init__(self, reason: str, error: str):
        super().__init__(error)
        self.reason = reason


def outside_namespace() -> dict:
    """Globals of the judge's evaluation: the trusted builtins and modules only."""
    return {"__builtins__": {name: getattr(builtins, name) for name in SAFE_BUILTINS}, **TRUSTED_MODULES}


def judge(plan: Plan, lines: list[dict]) -> dict:
    """Verdict from the runner's lines: {"reason", "passed", "total", "failures", "exc"} (reason "" = the
    runner stopped before the end: the caller explains why from how the process ended)."""
    by_id: dict[int, dict] = {}
    stopped, tampered = None, False
    for line in lines:
        if line.get("kind") == "probe" and isinstance(line.get("id"), int):
            tampered |= line["id"] in by_id  # the runner sends each probe once: a second line was forged
            by_id.setdefault(line["id"], line)
        elif line.get("kind") == "stopped" and stopped is None:
            stopped = line
    total, passed, failures = len(plan.checks), 0, []
    ns = outside_namespace()
    for kind, arg, line in plan.actions:
        if kind == "bind":
            try:
                exec(arg, ns)  # noqa: S102 - the tests' own setup (trusted), on no program value
                continue
            except Exception as exc:  # noqa: BLE001 - like a test file that raises here: stop
                failures.append({"line": line, "reason": "error", "exc": f"the tests' setup raised: "
                                 f"{type(exc).__name__}: {exc}"[:500]})
                break
        got = by_id.get(arg)
        if got is None:
            break  # the runner never got here
        reason, exc = _judge_one(plan.checks[arg], got, ns)
        if reason is None:
            passed += 1
            continue
        failures.append({"line": line, "reason": reason, "exc": exc})
        if reason != "tests_failed":
            break
    if tampered:
        failures.insert(0, {"line": 0, "reason": "tampered", "exc": "a test result was reported twice"})
    if failures:
        reason = failures[0]["reason"]
    elif stopped is not None:
        reason = str(stopped.get("reason") or "error")
        failures.append({"line": stopped.get("line", 0), "reason": reason, "exc": str(stopped.get("exc", ""))[:500]})
    elif len(by_id) < total:
        reason = ""
    else:
        reason = "passed" if total else "no_tests"
    return {"reason": reason, "passed": passed, "total": total, "failures": failures[:5],
            "exc": failures[0]["exc"] if failures else ""}


def _judge_one(check: Check, got: dict, ns: dict) -> tuple[str | None, str]:
    entries = got.get("values")
    if not isinstance(entries, list) or len(entries) != len(check.parts):
        return "bad_result_type", "unreadable result from the sandbox (wrong number of values)"

    def part(i: int):
        entry = entries[i]
        if isinstance(entry, dict) and "err" in entry:
            why = entry.get("why") if entry.get("why") in RUNNER_REASONS else "error"
            raise PartFailed(why, str(entry["err"])[:500])
        try:
            return decode_value(entry)
        except (ValueError, TypeError, OverflowError, RecursionError) as exc:
            raise PartFailed("bad_result_type", f"unreadable value from the sandbox ({exc})") from None

    try:
        ok = bool(eval(check.expr, {**ns, LEAF: part}))  # noqa: S307 - trusted test code on plain values
    except PartFailed as exc:
        return exc.reason, f"line {check.line}: {exc}"
    except Exception as exc:  # noqa: BLE001 - e.g. 3 < "a": a failed test, not a crash
        return "tests_failed", f"line {check.line}: {type(exc).__name__}: {exc}"
    if ok:
        return None, ""
    shown = "; ".join(f"{src} -> {_show(e)}" for src, e in zip(check.parts, entries))
    return "tests_failed", f"AssertionError: line {check.line}" + (f": {shown}" if shown else "") + (
        f" ({check.message})" if check.message else "")


def _show(entry) -> str:
    try:
        return repr(decode_value(entry))[:80]
    except Exception:  # noqa: BLE001 - an error entry or a malformed value
        return str(entry.get("err", "?") if isinstance(entry, dict) else "?")[:80]


# reasons a runner may report for a part that raised; anything else is reported as "error"
RUNNER_REASONS = {"error", "memory_limit", "process_limit", "network_blocked", "write_blocked", "read_blocked",
                  "syscall_blocked", "bad_result_type", "tests_failed"}
