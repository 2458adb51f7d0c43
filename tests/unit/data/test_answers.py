"""Answer extraction table: strict (last \\boxed{N}) and lenient (last number), right and wrong cases."""
from __future__ import annotations

from fractions import Fraction

import pytest

from areal_mq.data.answers import (
    canonical_number,
    extract_boxed_number,
    extract_last_number,
    format_number,
    grade,
    last_boxed_content,
    numbers_equal,
)

LENIENT = [
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


@pytest.mark.parametrize("text,expected", LENIENT)
def test_extract_last_number(text, expected):
    assert extract_last_number(text) == expected


STRICT = [
    ("So the answer is \\boxed{7}.", "7"),
    ("\\boxed{ 1,000 }", "1000"),
    ("\\boxed{-3}", "-3"),
    ("\\boxed{2.50}", "2.5"),
    ("first \\boxed{3} then \\boxed{4}", "4"),  # the last box counts
    ("\\boxed{4} and an unclosed \\boxed{5", "4"),
    ("\\boxed{x = 3}", None),
    ("\\boxed{}", None),
    ("\\boxed{3 apples}", None),
    ("\\boxed{\\frac{1}{2}}", None),
    ("The answer is 7.", None),
    ("boxed{7}", None),
    ("\\boxed 7", None),
]


@pytest.mark.parametrize("text,expected", STRICT)
def test_extract_boxed_number(text, expected):
    assert extract_boxed_number(text) == expected


def test_last_boxed_content_balances_braces():
    assert last_boxed_content("a \\boxed{\\frac{1}{2}} b") == "\\frac{1}{2}"
    assert last_boxed_content("no box") is None


@pytest.mark.parametrize(
    "text,expected",
    [("1,000", "1000"), (" -2.50 ", "-2.5"), ("+3", "3"), ("007", "7"), ("5 apples", None), ("1,00", None), ("", None)],
)
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


def test_grade_tells_format_from_arithmetic():
    right_unboxed = grade("3 + 4 = 7", "7")
    assert right_unboxed["lenient"] and not right_unboxed["strict"]
    right_boxed = grade("3 + 4 = 7, so \\boxed{7}.", "7")
    assert right_boxed["lenient"] and right_boxed["strict"]
    wrong_boxed = grade("\\boxed{8}", "7")
    assert not wrong_boxed["lenient"] and not wrong_boxed["strict"]
    boxed_then_chatter = grade("\\boxed{7} (from 3 and 4)", "7")
    assert boxed_then_chatter["strict"] and not boxed_then_chatter["lenient"]
