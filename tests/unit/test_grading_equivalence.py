r"""The held-out set of equivalent answers: evaluation (areal_mq.grading.grade) and the math reward read them the
same way, so a MATH answer written in LaTeX counts (\frac{1}{2} = 0.5 = 1/2), while the arithmetic task's
strict/lenient rules stay: one box for strict, words in a box are not a number, hedging earns nothing.
Run: pytest tests/unit/test_grading_equivalence.py -q
"""
from __future__ import annotations

import pytest

from areal_mq.grading import grade
from areal_mq.rewards.math_rewards import math_reward

# (completion, reference, strict, lenient)
CASES = [
    (r"so \boxed{\frac{1}{2}}", "0.5", True, True),
    (r"\boxed{0.5}", r"\frac{1}{2}", True, True),
    (r"\boxed{1/2}", r"\frac12", True, True),
    (r"\boxed{\dfrac{3}{4}}", "0.75", True, True),
    (r"\boxed{\tfrac{3}{4}}", 0.75, True, True),
    (r"\boxed{50\%}", "0.5", True, True),
    (r"\boxed{x^2+2x+1}", "(x+1)^2", True, True),
    (r"\boxed{\sqrt{2}/2}", r"\frac{\sqrt{2}}{2}", True, True),
    (r"\boxed{2\sqrt{3}}", r"\sqrt{12}", True, True),
    (r"\boxed{\{1,2\}}", r"\{2,1\}", True, True),
    (r"\boxed{\pi}", r"\pi", True, True),
    (r"\boxed{1{,}000}", "1000", True, True),
    (r"The answer is $\frac{1}{2}$.", "0.5", False, True),  # no box: lenient reads the last expression
    (r"\boxed{3} or \boxed{\frac12}", "0.5", False, True),  # a hedge: never strict
    (r"\boxed{\frac{1}{3}}", "0.5", False, False),
    (r"\boxed{\frac{1}{2}+1}", "0.5", False, False),
    (r"\boxed{7 apples}", 7, False, True),  # words in the box: not strict, as before
    (r"so \boxed{7}", 7, True, True),
    (r"\boxed{8}", 7, False, False),
    (r"\boxed{-\frac{3}{2}}", "-1.5", True, True),
    ("no answer at all", r"\frac{1}{2}", False, False),
]


@pytest.mark.parametrize("completion, reference, strict, lenient", CASES)
def test_equivalent_answers(completion, reference, strict, lenient):
    verdict = grade(completion, reference)
    assert (verdict.strict, verdict.lenient) == (strict, lenient), verdict
    assert not verdict.strict or verdict.lenient  # every strict answer is a lenient one
    assert math_reward("", completion, reference)["correct"] is lenient  # the reward reads it the same way


def test_plain_arithmetic_never_needs_math_verify(monkeypatch):
    """The arithmetic task's numbers compare exactly, without sympy: a right or wrong plain-number box is
    decided before math-verify could be asked."""
    import areal_mq.grading as grading

    def boom(*a, **k):
        raise AssertionError("math-verify was called for a plain number")

    monkeypatch.setattr(grading, "math_equivalent", boom)
    monkeypatch.setattr(grading, "_math_equal_completion", boom)
    assert grade(r"so \boxed{12}", 12).strict
    assert not grade(r"so \boxed{13}", 12).lenient
    assert grade("it is 1,000 in all", "1000").lenient
