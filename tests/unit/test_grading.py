r"""The one grader (areal_mq.grading): answer reading, number normalisation, and the proof that the reward
and evaluation judge the same completions alike.

Run: pytest tests/unit/test_grading.py -q
"""
from __future__ import annotations

from fractions import Fraction

import pytest

from areal_mq.grading import (
    canonical_number,
    find_boxes,
    format_number,
    grade,
    last_number,
    lenient_answer,
    normalize_reference,
    numbers_equal,
    parse_gsm8k_answer,
    strict_answer,
)
from areal_mq.rewards.arith_reward import arith_reward
from areal_mq.rewards.math_rewards import format_reward

# completion, reference, strict, lenient
SAME_VERDICTS = [
    ("3 + 4 = 7, so \\boxed{7}.", 7, True, True),  # one box, right
    ("It is \\boxed{6} or \\boxed{7}.", 7, False, True),  # a hedge: two boxes are never strictly right
    ("first \\boxed{3}, no wait: \\boxed{7}", 7, False, True),  # only the last box is right (eval's old strict: yes)
    ("The answer is 4", 4, False, True),  # stated, not boxed
    ("\\boxed{8}", 7, False, False),
    ("\\boxed{7} (from 3 and 4)", 7, True, True),  # a box wins over later numbers (eval's old lenient: no)
    ("\\boxed{7} and then \\boxed{7", 7, False, True),  # an unclosed box is a malformed second attempt
    ("3 + 4 = 7, so the answer is \\boxed{N}", 7, False, True),  # a copied literal N: the last number counts
    ("\\boxed{7.0}", 7, True, True),  # the same number
    ("\\boxed{1{,}000}", "#### 1,000", True, True),  # LaTeX thousands, GSM8K reference
    ("\\fbox{-3}", "-3", True, True),
    ("nothing here", 7, False, False),
]


@pytest.mark.parametrize("completion,reference,strict,lenient", SAME_VERDICTS)
def test_reward_and_evaluation_agree(completion, reference, strict, lenient):
    verdict = grade(completion, reference)
    assert (verdict.strict, verdict.lenient) == (strict, lenient)
    assert strict <= lenient  # every strict answer is a lenient one
    reward = arith_reward("", completion, reference)
    assert reward["correct"] is strict and (reward["reward"] == 1.0) is strict
    shaped = arith_reward("", completion, reference, lenient_correct_reward=0.25)
    if strict_answer(completion).form == "no_box":  # shaping pays a right lenient answer, if there is no box
        assert (shaped["reason"] == "unboxed_correct") is lenient
    assert format_reward("", completion)["format"] == strict_answer(completion).form


def test_the_reward_may_withhold_pay_but_never_pays_what_strict_calls_wrong():
    right = "so \\boxed{7}"
    assert grade(right, 7).strict
    assert not arith_reward("", right, 7, truncated=True)["correct"]
    assert not arith_reward("", right + " Let me check that again. " * 5, 7)["correct"]  # box not final
    for completion, reference, strict, _ in SAME_VERDICTS:
        for truncated in (False, True):
            assert strict or not arith_reward("", completion, reference, truncated=truncated)["correct"]


LAST_NUMBER = [
    ("The answer is 42.", "42"),
    ("3 + 4 = 7", "7"),
    ("10-3=7", "7"),  # a minus glued to a number is an operator, not a sign
    ("She has 1,234 apples.", "1234"),
    ("It costs $1,234,567.50 in total", "1234567.5"),
    ("The result is -15", "-15"),
    ("The result is \u221215", "-15"),  # Unicode minus
    ("x = -3.25.", "-3.25"),
    ("about .5 of it", "0.5"),
    ("2.50", "2.5"),
    ("first 8, then 9", "9"),
    ("1,2,3", "3"),
    ("\\boxed{12}", "12"),
    ("x_1 is 5", "5"),
    ("no digits here", None),
    ("", None),
]


@pytest.mark.parametrize("text,expected", LAST_NUMBER)
def test_last_number(text, expected):
    assert last_number(text) == expected


STRICT = [
    ("So the answer is \\boxed{7}.", "ok", "7"),
    ("\\boxed{ 1,000 }", "ok", "1000"),
    ("\\boxed{-3}", "ok", "-3"),
    ("\\boxed{2.50}", "ok", "2.5"),
    ("\\boxed{$12$}", "ok", "12"),
    ("\\boxed{12\\,345}", "ok", "12345"),
    ("\\fbox{7}", "ok", "7"),
    ("first \\boxed{3} then \\boxed{4}", "multiple_boxes", None),
    ("\\boxed{4} and an unclosed \\boxed{5", "unclosed_box", None),
    ("\\boxed{}", "empty_box", None),
    ("\\boxed{x = 3}", "ok", None),
    ("\\boxed{3 apples}", "ok", None),
    ("\\boxed{\\frac{1}{2}}", "ok", None),
    ("The answer is 7.", "no_box", None),
    ("boxed{7}", "no_box", None),
    ("\\boxed 7", "no_box", None),
]


@pytest.mark.parametrize("text,form,value", STRICT)
def test_strict_answer(text, form, value):
    answer = strict_answer(text)
    assert (answer.form, answer.value) == (form, value)


def test_strict_answer_marks_where_the_box_ends():
    text = "so \\boxed{7}. Done"
    assert text[strict_answer(text).end:] == ". Done"


@pytest.mark.parametrize("text,expected", [
    ("\\boxed{3} then \\boxed{4} and 5", "4"),
    ("\\boxed{4} then \\boxed{x}", "4"),
    ("7, so \\boxed{N}", "7"),
    ("so 12", "12"),
    ("none", None),
])
def test_lenient_answer(text, expected):
    assert lenient_answer(text) == expected


def test_boxes_with_nested_and_unclosed_braces():
    b = find_boxes(r"a \boxed{\frac{1}{2}} b \boxed{3} c \boxed{4")
    assert b.contents == [r"\frac{1}{2}", "3"] and b.unclosed == 1


@pytest.mark.parametrize("text,expected", [
    ("1,000", "1000"), (" -2.50 ", "-2.5"), ("+3", "3"), ("007", "7"), ("$12$", "12"), ("1{,}000", "1000"),
    ("1\\,000", "1000"), ("1 000", "1000"), ("1 2", None), ("5 apples", None), ("1,00", None), ("", None),
])
def test_canonical_number(text, expected):
    assert canonical_number(text) == expected


def test_format_number_is_exact():
    assert format_number(Fraction(1, 8)) == "0.125"
    assert format_number(Fraction(-5, 2)) == "-2.5"
    assert format_number(Fraction(1, 3)) == "1/3"
    assert format_number(Fraction(123456789012345678, 1000)) == "123456789012345.678"


@pytest.mark.parametrize(
    "a,b,equal",
    [("5", "5.0", True), ("1,000", 1000, True), (2.5, "2.50", True), ("-3", "3", False), (None, "3", False),
     ("abc", "abc", False), ("1/3", "1/3", True), (True, 1, False),
     (0.1, "0.1", True), (float("nan"), "1", False)],
)
def test_numbers_equal(a, b, equal):
    assert numbers_equal(a, b) is equal


def test_references():
    assert parse_gsm8k_answer("Natalia sold 48/2 = 24 clips.\n#### 72") == "72"
    assert parse_gsm8k_answer("#### 1,234") == "1234"
    assert parse_gsm8k_answer("#### $5.") == "5"
    assert parse_gsm8k_answer("no marker 5") is None
    assert normalize_reference(0.5) == "0.5" and normalize_reference(" 12 ") == "12"
    for bad in (None, True, [1]):
        with pytest.raises(ValueError, match="reference"):
            normalize_reference(bad)
