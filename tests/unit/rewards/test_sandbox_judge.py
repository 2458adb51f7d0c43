"""Tests are judged outside the program: what the sandbox gets, what a forged status line can and cannot do,
and that ordinary test files still mean what Python says they mean.

The first half needs no sandbox (plan_tests and judge on hand-made runner lines); the second runs real
programs in the default sandbox. Run: pytest tests/unit/rewards/test_sandbox_judge.py -q   (~5 s)
"""
from __future__ import annotations

import json

import pytest

from areal_mq.rewards.config import SandboxConfig
from areal_mq.rewards.sandbox.runner import CodeSandbox
from areal_mq.rewards.sandbox.assert_judge import judge, plan_tests

LIMITS = dict(timeout_s=8.0, cpu_s=2, memory_mb=256, max_processes=12, max_output_bytes=8192)


def _probe(check_id, *values):
    return {"kind": "probe", "id": check_id, "values": list(values)}


def _verdict(tests, lines, program=""):
    return judge(plan_tests(tests, program), lines)


def test_expected_values_never_enter_the_sandbox():
    plan = plan_tests("expected = [1, 4, 9]\nlimit = 10 ** 6\n"
                      "assert [sq(i) for i in range(3)] == expected\nassert abs(sq(0.5) - 0.25) < 1e-9\n"
                      "assert sq(3) == 9 and not sq(2) == 5\nassert sq(7) < limit")
    assert [s["kind"] for s in plan.steps] == ["probe"] * 4  # the setup runs in the reward worker only
    assert [s["exprs"] for s in plan.steps] == [["[sq(i) for i in range(3)]"], ["sq(0.5)"], ["sq(3)", "sq(2)"],
                                                ["sq(7)"]]
    assert "limit" not in json.dumps(plan.steps) and "expected" not in json.dumps(plan.steps)


def test_a_forged_value_is_only_a_claimed_return_value():
    """A program that writes "True" for every part no longer passes `not`, arithmetic around a call, or a
    comparison with an expected value it never saw."""
    t = "assert is_prime(7)\nassert not is_prime(8)"
    assert _verdict(t, [_probe(0, {"b": True}), _probe(1, {"b": True})])["reason"] == "tests_failed"
    t = "assert abs(f(0.1) - 0.3) < 1e-9"
    assert _verdict(t, [_probe(0, {"f": 0.0})])["reason"] == "tests_failed"
    t = "assert f(1) == [1] * 3"
    assert _verdict(t, [_probe(0, {"l": [{"i": 1}]})])["reason"] == "tests_failed"


def test_a_result_reported_twice_is_tampering():
    v = _verdict("assert f(1) == 2", [_probe(0, {"i": 2}), _probe(0, {"i": 3})])
    assert v["reason"] == "tampered" and v["passed"] == 1


def test_plain_values_round_trip_with_python_semantics():
    t = ("assert f() == 2 ** 70\nassert f2() == 1180591620717411303424\nassert g() == frozenset({1})\n"
         "assert h() != h()\nassert k() is None\nassert 3 < k2() <= 4\nassert 'a' in d()")
    lines = [_probe(0, {"x": hex(2 ** 70)}), _probe(1, {"x": hex(2 ** 70)}), _probe(2, {"fset": [{"i": 1}]}),
             _probe(3, {"f": "nan"}, {"f": "nan"}), _probe(4, {"n": None}), _probe(5, {"i": 4}),
             _probe(6, {"d": [[{"s": "a"}, {"t": []}]]})]
    v = _verdict(t, lines)
    assert (v["reason"], v["passed"]) == ("passed", 7), v


def test_a_part_that_raised_counts_only_where_the_verdict_needs_it():
    t = "assert f() is None or g() == 1\nassert h() == 1"
    err = {"err": "AttributeError: x", "why": "error"}
    assert _verdict(t, [_probe(0, {"n": None}, err), _probe(1, {"i": 1})])["reason"] == "passed"
    v = _verdict(t, [_probe(0, {"i": 0}, err), _probe(1, {"i": 1})])
    assert v["reason"] == "error" and "AttributeError" in v["exc"]
    bad = {"err": "TypeError: a E is not a plain value", "why": "bad_result_type"}
    assert _verdict("assert add(2, 2) == 5", [_probe(0, bad)])["reason"] == "bad_result_type"


def test_the_programs_own_builtins_are_what_the_tests_call():
    plan = plan_tests("assert sorted([3, 1]) == [1, 3]", "def sorted(xs):\n    return xs\n")
    assert plan.steps[0]["exprs"] == ["sorted([3, 1])"]
    assert plan_tests("assert sorted([3, 1]) == [1, 3]", "import math\n").steps[0]["exprs"] == []


def test_test_data_never_joins_a_part():
    """A builtin over parts only may run in the sandbox (len(x)); a lambda or helper the tests wrote may hold
    the expected value, so it never does."""
    steps = plan_tests("check = lambda x: x == [1, 2]\nassert check(f())\nassert (lambda x: x == [3])(g())\n"
                       "assert ', '.join(h()) == 'a, b'\nassert len(k()) == 2\nimport math\n"
                       "assert math.isclose(m(), 0.5)").steps
    assert [s.get("exprs", s.get("src")) for s in steps] == [["f()"], ["g()"], ["h()"], ["len(k())"], "import math",
                                                             ["m()"]]


def test_setup_that_the_sandbox_reads_runs_there():
    plan = plan_tests("data = [3, 1]\nexpected = [1, 3]\nsort_in_place(data)\nassert data == expected")
    assert [s.get("src") for s in plan.steps] == ["data = [3, 1]", "sort_in_place(data)", None]
    assert plan.steps[-1]["exprs"] == ["data"]


# ---------------------------------------------------------------- real runs
@pytest.fixture(scope="module")
def box():
    return CodeSandbox(SandboxConfig(**LIMITS))


@pytest.mark.parametrize("program,tests", [
    ("class Stack:\n    def __init__(self):\n        self.xs = []\n    def push(self, x):\n        self.xs.append(x)\n"
     "    def pop(self):\n        return self.xs.pop()\n",
     "s = Stack()\ns.push(1)\ns.push(2)\nassert s.pop() == 2\nassert len(s.xs) == 1"),
    ("def gen(n):\n    yield from range(n)\n", "assert list(gen(3)) == [0, 1, 2]\nassert sum(gen(4)) == 6"),
    ("def blob():\n    return bytearray(b'abc')\n", "assert len(blob()) == 3\nassert bytes(blob()) == b'abc'"),
    ("def f(x):\n    return x / 3\n", "import math\nassert math.isclose(f(1), 1 / 3)\nassert round(f(1), 2) == 0.33"),
    ("def big():\n    return 3 ** 5000\n", "assert big() == 3 ** 5000\nassert big() % 7 == pow(3, 5000, 7)"),
    ("def sq(x):\n    return x * x\n", "expected = [0, 1, 4]\nassert [sq(i) for i in range(3)] == expected"),
    ("def sort_in_place(xs):\n    xs.sort()\n", "data = [3, 1, 2]\nsort_in_place(data)\nassert data == [1, 2, 3]"),
    ("def d():\n    return {'a': 1}\n", "assert sorted(d().keys()) == ['a']\nassert d().get('b') is None"),
])
def test_ordinary_tests_still_pass(box, program, tests):
    r = box.run(program, tests)
    assert r.passed, r


def test_a_wrong_answer_still_fails_with_what_it_returned(box):
    r = box.run("def sq(x):\n    return x + x\n", "assert sq(2) == 4\nassert sq(3) == 9, 'three'")
    assert (r.reason, r.tests_passed) == ("tests_failed", 1) and "sq(3) -> 6" in r.message and "three" in r.message
