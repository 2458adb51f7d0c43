r"""The one grader: how a completion's final answer is read, and when it counts as correct.

What: rewards (areal_mq.rewards: arith, format, math) and evaluation (areal_mq.evaluation.heldout,
areal_mq.data.measure_base) read answers here, so "correct" means the same in training and in the
numbers a run reports. Two verdicts:

    strict   EXACTLY ONE well-formed `\boxed{...}` (or `\fbox{...}`), no unclosed box anywhere, and its
             content is a number equal to the reference.   "so \boxed{7}" -> 7;  "\boxed{3} or \boxed{7}" -> none
    lenient  the last boxed number, else the last number in the text, equals the reference.
                                                         "\boxed{3} or \boxed{7}" -> 7;  "The answer is 7." -> 7

Why strict counts the boxes: a completion that boxes several answers is hedging. If any box (or the last
box) counted, RL would pay for listing candidates, and a peer's GRPO run did learn to box the answer and
then repeat boxes until the length cap. So a hedge earns no reward and is not correct in evaluation.
Why lenient: it tells arithmetic from format learning (the base model rarely boxes), and every strict
answer is also a lenient one. Rewards may withhold pay for form on top of strict (arith: a truncated,
repetitive or box-not-final completion), never pay as correct what strict calls wrong. The `math` reward pays
the lenient verdict of this grader.

Math: where the reference is not a plain number, or the box holds math ("\\frac{1}{2}", "\\sqrt{2}/2", "50\\%"),
answers compare with math-verify (`math_equivalent`), so "\\frac{1}{2}", "0.5" and "1/2" agree in rewards and
evaluation alike (tests/unit/test_grading_equivalence.py holds the equivalent-answer cases).

Numbers: "1,000", "1{,}000", "1\,000", "$12$", "-2.50", "\u22123" are plain numbers; answers come back as
canonical strings ("1000", "-2.5", "1/3" when the decimal does not terminate) and compare exactly (Fraction).
References may be numbers, strings or GSM8K solutions ending in "#### N".

Run: python -c "from areal_mq.grading import grade; print(grade('so \\boxed{7}', 7))"
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from fractions import Fraction

_BOX_OPEN = re.compile(r"\\(?:boxed|fbox)\s*\{")
# One number: thousands-grouped ("1,234,567") or plain ("1234", "3.5", ".5"). A leading minus counts only when
# it is not glued to a word/number before it, so "10-3=7" yields 10, 3, 7 and never "-3".
_NUMBER = r"(?:\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?|\.\d+)"
_NUMBER_IN_TEXT = re.compile(rf"(?<![\w.])([-\u2212]?)({_NUMBER})(?![\d])")
_PLAIN_NUMBER = re.compile(rf"^\s*([-\u2212+]?)\s*({_NUMBER})\s*$")
_DIGIT_SPACE = re.compile(r"(?<=\d) (?=\d)")  # "1 000": a space between digits separates thousands


@dataclass
class Boxes:
    r"""Every `\boxed{}` in a text: `contents` of the well-formed ones, `unclosed` count, and where the
    last well-formed one ends (`last_end`, -1 if none)."""

    contents: list[str] = field(default_factory=list)
    unclosed: int = 0
    last_end: int = -1


@dataclass(frozen=True)
class StrictAnswer:
    r"""The strict reading of a completion.

    form    "ok" (exactly one non-empty box, none unclosed) | "no_box" | "multiple_boxes" | "unclosed_box"
            | "empty_box"
    value   the box's number, canonical ("1000"), when form is "ok" and the box holds a plain number
    end     index just past the last well-formed box (-1 if none): what follows it is trailing text
    """

    form: str
    value: str | None = None
    end: int = -1


@dataclass(frozen=True)
class Grade:
    """Both verdicts for one completion, with the answers they read (None when there is none)."""

    strict: bool
    lenient: bool
    strict_answer: str | None
    lenient_answer: str | None


def find_boxes(text: str) -> Boxes:
    r"""All `\boxed{...}` / `\fbox{...}` contents in order, braces balanced (`\boxed{\frac{1}{2}}` works)."""
    found = Boxes()
    pos = 0
    while True:
        m = _BOX_OPEN.search(text, pos)
        if m is None:
            return found
        depth, i = 1, m.end()
        while i < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
        if depth:
            found.unclosed += 1
            pos = m.end()
            continue
        found.contents.append(text[m.end(): i - 1].strip())
        found.last_end = i
        pos = i


def strict_answer(text: str) -> StrictAnswer:
    """The one boxed answer of `text`, or why there is none (see StrictAnswer.form)."""
    boxes = find_boxes(text)
    if boxes.unclosed:
        return StrictAnswer("unclosed_box", end=boxes.last_end)
    if not boxes.contents:
        return StrictAnswer("no_box")
    if len(boxes.contents) > 1:
        return StrictAnswer("multiple_boxes", end=boxes.last_end)
    if not boxes.contents[0]:
        return StrictAnswer("empty_box", end=boxes.last_end)
    return StrictAnswer("ok", canonical_number(boxes.contents[0]), boxes.last_end)


def lenient_answer(text: str) -> str | None:
    """The number in the last box that holds one, else the last number anywhere in the text (canonical)."""
    for content in reversed(find_boxes(text).contents):
        value = canonical_number(content)
        if value is not None:
            return value
    return last_number(text)


def grade(completion: str, reference) -> Grade:
    r"""Strict and lenient verdicts of `completion` against `reference` (number, text, LaTeX or GSM8K solution).

    Plain numbers compare exactly (Fraction). Where the reference is not a plain number, or the one box holds
    math rather than a number ("\frac{1}{2}", "\sqrt{2}/2", "50\%"), the comparison is math-verify's
    (`math_equivalent`), so "\frac{1}{2}", "0.5" and "1/2" agree; the form rules (exactly one box for
    strict) are the same either way. A box with words in it ("7 apples") stays wrong under strict."""
    gold = normalize_reference(reference)
    form = strict_answer(completion)
    strict_v, lenient_v = form.value, lenient_answer(completion)
    strict, lenient = numbers_equal(strict_v, gold), numbers_equal(lenient_v, gold)
    numeric_gold = _to_fraction(gold) is not None
    if not strict and form.form == "ok":
        box = find_boxes(completion).contents[0]
        if (not numeric_gold or _MATH_MARK.search(box)) and math_equivalent(box, gold):
            strict, strict_v = True, box
    if not lenient:
        boxes = find_boxes(completion).contents
        if strict:  # every strict answer is a lenient one
            lenient, lenient_v = True, strict_v
        elif boxes:  # the last box, read as math when it is math (or the reference is)
            if (not numeric_gold or _MATH_MARK.search(boxes[-1])) and math_equivalent(boxes[-1], gold):
                lenient, lenient_v = True, boxes[-1]
        elif not numeric_gold or "\\" in completion:  # no box: math-verify's last expression
            lenient, expr = _math_equal_completion(completion, gold)
            lenient_v = expr if lenient else lenient_v
    return Grade(strict, lenient, strict_v, lenient_v)


_MATH_MARK = re.compile(r"\\|/|\^|%|\{")  # a LaTeX command, a fraction slash, a power, a percent, braces


def _mv_timeout() -> int | None:
    """math-verify's timeouts use signal.alarm, which works only in a main thread: elsewhere none (the
    caller's own deadline applies: the reward executor's per-call one)."""
    import threading

    return 5 if threading.current_thread() is threading.main_thread() else None


def parse_gold(reference) -> list:
    """math-verify's parse of a reference answer; plain answers are read as LaTeX math ('$...$')."""
    from math_verify import parse

    text = normalize_reference(reference)
    wrapped = text if ("$" in text or "\\boxed" in text or "\\(" in text) else f"${text}$"
    return parse(wrapped, parsing_timeout=_mv_timeout()) or parse(text, parsing_timeout=_mv_timeout())


def math_equivalent(expression: str, reference) -> bool:
    r"""True when `expression` (an extracted answer: a box's content) equals `reference` for math-verify
    ("\frac{1}{2}" vs "0.5", "\{1,2\}" vs "\{2,1\}", "(x+1)^2" vs "x^2+2x+1"); False when either side
    does not parse. math-verify (sympy) is imported here, on first use: plain-number grading never pays it."""
    from math_verify import parse, verify

    gold = parse_gold(reference)
    wrapped = expression if "$" in expression else f"${expression}$"
    pred = parse(wrapped, parsing_timeout=_mv_timeout())
    return bool(gold) and bool(pred) and bool(verify(gold, pred, timeout_seconds=_mv_timeout()))


def _math_equal_completion(completion: str, reference) -> tuple[bool, str | None]:
    """math-verify on a whole completion: its last box, else its last expression (the lenient reading);
    (equal, the expression it read)."""
    from math_verify import parse, verify

    gold = parse_gold(reference)
    pred = parse(completion, parsing_timeout=_mv_timeout())
    equal = bool(gold) and bool(pred) and bool(verify(gold, pred, timeout_seconds=_mv_timeout()))
    return equal, (str(pred[-1]) if pred else None)


def last_number(text: str) -> str | None:
    """The last number in `text`, canonical ("costs $1,234." -> "1234", "x = \u22123" -> "-3"), or None.

    A minus glued to what precedes it is an operator ("10-3=7" -> "7"); a sentence-final period is not a
    decimal point ("is 12." -> "12").
    """
    last = None
    for last in _NUMBER_IN_TEXT.finditer(text):
        pass
    if last is None:
        return None
    return _canonical(last.group(1), last.group(2))


def canonical_number(text: str) -> str | None:
    r"""Canonical string of a whole-string number ("1,000" -> "1000", "-2.50" -> "-2.5", "$12$" -> "12",
    "1{,}000" / "1\,000" / "1 000" -> "1000"); None for anything else ("5 apples", "1,00", "x=3")."""
    t = text.strip().strip("$").replace("{,}", ",").replace("\\,", ",")
    m = _PLAIN_NUMBER.match(_DIGIT_SPACE.sub(",", t))
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


def parse_gsm8k_answer(reference: str) -> str | None:
    """The final answer of a GSM8K solution: the text after the last '####', commas and '$' removed.

    '... so she has 18 eggs.\\n#### 1,018' -> '1018'. None when there is no '####' marker.
    """
    if "####" not in reference:
        return None
    answer = reference.rsplit("####", 1)[1].strip()
    answer = answer.replace(",", "").replace("$", "").strip()
    return answer.rstrip(".") or None


def normalize_reference(reference) -> str:
    """A reference answer as text: numbers as written, GSM8K solutions reduced to their '#### N' answer."""
    if reference is None:
        raise ValueError("grading needs a reference answer, got None; set RewardJob.reference")
    if isinstance(reference, bool):
        raise ValueError(f"reference must be a number or text, got a bool ({reference})")
    if isinstance(reference, (int, float)):
        return repr(reference) if isinstance(reference, float) else str(reference)
    if not isinstance(reference, str):
        raise ValueError(f"reference must be a number or text, got {type(reference).__name__}")
    gsm = parse_gsm8k_answer(reference)
    return gsm if gsm is not None else reference.strip()
