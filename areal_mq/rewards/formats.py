r"""Answer-format helpers shared by the math, arith and format rewards (pure text, no heavy imports).

What: find `\boxed{...}` answers with balanced braces (and notice unclosed ones), parse GSM8K-style
`#### N` references, find the last number in a text, and detect degenerate repetition.
Why: a policy learns whatever the reward pays for; a peer's GRPO run learned to box the answer and then
repeat boxes until the length cap. These helpers let rewards see exactly one well-formed final answer.
"""
from __future__ import annotations

import re
import zlib
from dataclasses import dataclass, field

_BOX_OPEN = re.compile(r"\\(?:boxed|fbox)\s*\{")
_NUMBER = re.compile(r"(?<![\w.])-?(?:\d[\d,]*(?:\.\d+)?|\.\d+)|\d[\d,]*(?:\.\d+)?")
_INT = re.compile(r"^[+-]?\d{1,3}(?:,\d{3})+$|^[+-]?\d+$")


@dataclass
class Boxes:
    r"""Every `\boxed{}` in a text: `contents` of the well-formed ones, `unclosed` count, and where the
    last well-formed one ends (`last_end`, -1 if none)."""

    contents: list[str] = field(default_factory=list)
    unclosed: int = 0
    last_end: int = -1


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


def last_boxed(text: str) -> str | None:
    r"""Content of the last well-formed `\boxed{}`, or None."""
    boxes = find_boxes(text)
    return boxes.contents[-1] if boxes.contents else None


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
        raise ValueError("this reward needs a reference answer, got None; set RewardJob.reference")
    if isinstance(reference, bool):
        raise ValueError(f"reference must be a number or text, got a bool ({reference})")
    if isinstance(reference, (int, float)):
        return repr(reference) if isinstance(reference, float) else str(reference)
    if not isinstance(reference, str):
        raise ValueError(f"reference must be a number or text, got {type(reference).__name__}")
    gsm = parse_gsm8k_answer(reference)
    return gsm if gsm is not None else reference.strip()


def parse_int(text: str) -> int | None:
    """An integer written plainly ('42', '-7', '1,000', '$12$'), else None."""
    t = text.strip().strip("$").strip()
    t = t.replace("{,}", ",").replace("\\,", ",").replace(" ", "")
    if not _INT.match(t):
        return None
    return int(t.replace(",", ""))


def last_number(text: str) -> str | None:
    """The last number in a text with thousands separators removed ('costs $1,200.' -> '1200')."""
    nums = _NUMBER.findall(text)
    return nums[-1].replace(",", "") if nums else None


def repetition_reason(text: str, *, max_line_repeats: int = 3, min_line_chars: int = 6,
                      min_compress_chars: int = 400, min_compress_ratio: float = 0.12) -> str | None:
    """Why a text looks degenerate (a line repeated, or it compresses far too well), or None.

    Lines shorter than `min_line_chars` (blank lines, '}' ...) are ignored; the zlib check only runs on
    texts of at least `min_compress_chars` characters, where natural prose compresses to ~0.3-0.5.
    """
    counts: dict[str, int] = {}
    for line in text.splitlines():
        line = line.strip()
        if len(line) >= min_line_chars:
            counts[line] = counts.get(line, 0) + 1
    if counts:
        line, n = max(counts.items(), key=lambda kv: kv[1])
        if n >= max_line_repeats:
            return f"line repeated {n} times: {line[:40]!r}"
    raw = text.encode("utf-8", "replace")
    if len(raw) >= min_compress_chars:
        ratio = len(zlib.compress(raw, 6)) / len(raw)
        if ratio < min_compress_ratio:
            return f"text compresses to {ratio:.2f} of its size (repetitive)"
    return None
