"""Pure answer extraction and comparison for math-style tasks.

What: turn a model completion into a final answer two ways, and compare answers as numbers.

- strict  (`extract_boxed_number`): the answer is the content of the LAST `\\boxed{...}` and that content is a
  plain number (optionally with thousands commas, a sign, a decimal point). This is exactly the form our prompts
  ask for, so strict accuracy measures "followed the format AND got it right".
- lenient (`extract_last_number`): the last number anywhere in the text ("... so she has 1,234 apples." -> "1234").
  This measures arithmetic skill regardless of format.

Why here: the evaluation code (areal_mq.data) and the reward functions (areal_mq.rewards) must agree on what
"correct" means, so both import these functions. Everything is pure (str in, str/bool out), no model, no I/O.

Numbers are returned as canonical strings ("-1234", "2.5", "3") so they are hashable, JSON-safe, and compare
exactly through `numbers_equal` (which uses Fraction, never float rounding).

Run the tests: `pytest tests/unit/data/test_answers.py`.
"""
from __future__ import annotations

import re
from fractions import Fraction

# One number: thousands-grouped ("1,234,567") or plain ("1234", "3.5", ".5"). A leading minus counts only when
# it is not glued to a word/number before it, so "10-3=7" yields 10, 3, 7 and never "-3".
_NUMBER = r"(?:\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?|\.\d+)"
_NUMBER_IN_TEXT = re.compile(rf"(?<![\w.])([-\u2212]?)({_NUMBER})(?![\d])")
_PLAIN_NUMBER = re.compile(rf"^\s*([-\u2212+]?)\s*({_NUMBER})\s*$")
_BOXED = "\\boxed{"


def canonical_number(text: str) -> str | None:
    """Canonical string of a plain number ("1,000" -> "1000", "-2.50" -> "-2.5", "+3" -> "3"); None otherwise.

    Accepts only a whole-string number (surrounding whitespace allowed): "5 apples" is not a number here.
    """
    m = _PLAIN_NUMBER.match(text)
    if m is None:
        return None
    return _canonical(m.group(1), m.group(2))


def _canonical(sign: str, digits: str) -> str:
    value = Fraction(digits.replace(",", ""))
    if sign in ("-", "\u2212"):
        value = -value
    return format_number(value)


def format_number(value: Fraction | int) -> str:
    """Exact shortest text of a number: "3", "-2.5"; "a/b" when the decimal expansion does not terminate."""
    value = Fraction(value)
    if value.denominator == 1:
        return str(value.numerator)
    den = value.denominator
    for p in (2, 5):
        while den % p == 0:
            den //= p
    if den != 1:
        return f"{value.numerator}/{value.denominator}"
    # Long division on the exact fraction: float formatting would round long expansions.
    sign = "-" if value < 0 else ""
    whole, rest = divmod(abs(value.numerator), value.denominator)
    digits = []
    while rest:
        digit, rest = divmod(rest * 10, value.denominator)
        digits.append(str(digit))
    return f"{sign}{whole}.{''.join(digits)}"


def extract_last_number(text: str) -> str | None:
    """Lenient answer: the last number in `text` as a canonical string, or None if there is none.

    Handles thousands commas ("1,234"), negatives ("-7", also the Unicode minus), decimals ("3.5");
    a sentence-final period is not part of the number ("is 12." -> "12").
    """
    last = None
    for last in _NUMBER_IN_TEXT.finditer(text):
        pass
    if last is None:
        return None
    return _canonical(last.group(1), last.group(2))


def last_boxed_content(text: str) -> str | None:
    """Raw content of the last `\\boxed{...}` (balanced braces), or None if absent or unclosed."""
    start = text.rfind(_BOXED)
    while start != -1:
        content = _balanced(text, start + len(_BOXED))
        if content is not None:
            return content
        start = text.rfind(_BOXED, 0, start)
    return None


def _balanced(text: str, pos: int) -> str | None:
    depth = 1
    for i in range(pos, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[pos:i]
    return None


def extract_boxed_number(text: str) -> str | None:
    """Strict answer: the last `\\boxed{N}` whose content is a plain number, canonical; None otherwise.

    "\\boxed{1,234}" -> "1234"; "\\boxed{ -3 }" -> "-3"; "\\boxed{x=3}", "\\boxed{}", "boxed 3" -> None.
    """
    content = last_boxed_content(text)
    if content is None:
        return None
    return canonical_number(content)


def numbers_equal(a: str | int | float | None, b: str | int | float | None) -> bool:
    """True when both parse to the same number exactly ("5.0" == "5" == 5, "1,000" == "1000"); False on None."""
    fa, fb = _to_fraction(a), _to_fraction(b)
    return fa is not None and fb is not None and fa == fb


def _to_fraction(x: str | int | float | None) -> Fraction | None:
    if x is None or isinstance(x, bool):
        return None
    if isinstance(x, int):
        return Fraction(x)
    if isinstance(x, float):  # via its shortest repr: 0.1 means "0.1", not the binary fraction nearest to it
        return Fraction(repr(x)) if x == x and abs(x) != float("inf") else None
    canon = canonical_number(x)
    if canon is None:
        try:
            return Fraction(x.strip())  # canonical non-terminating form "a/b"
        except (ValueError, ZeroDivisionError):
            return None
    return Fraction(canon)


def grade(completion: str, reference: str | int | float) -> dict[str, bool | str | None]:
    """Both verdicts for one completion: {"strict": bool, "lenient": bool, "boxed": str|None, "last": str|None}."""
    boxed = extract_boxed_number(completion)
    last = extract_last_number(completion)
    return {
        "strict": numbers_equal(boxed, reference),
        "lenient": numbers_equal(last, reference),
        "boxed": boxed,
        "last": last,
    }
