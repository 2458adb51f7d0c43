r"""The `arith` task reward used by the main training job, plus the strict/lenient checkers evaluation uses.

What: `arith_reward` pays `correct_reward` only for a completion with EXACTLY ONE well-formed `\boxed{N}`
(N an integer), near the end of the text, equal to the reference, not truncated and not degenerate.
Why so strict: a peer's GRPO run (TRL) learned to box the answer and then repeat boxes until the length
cap; a reward that pays any correct box pays for that collapse. Here repeated boxes, unclosed boxes and
repeated lines earn `penalty`, a truncated completion (RewardJob.truncated) earns `truncated_reward`.

    reason          reward (defaults)
    correct         1.0   exactly one final \boxed{N}, N == reference
    wrong           0.0   one well-formed box with a wrong integer, or followed by too much text
    not_integer     0.0   (no_answer_reward) a box without an integer, e.g. a copied literal \boxed{N}
    no_box          0.0   (unboxed_correct: the last number is right but unboxed -> lenient_correct_reward,
                           0 by default; the quickstart pays 0.25 because the base model boxes ~2% of the time)
    multiple_boxes -0.5   malformed_box -0.5   repetition -0.5   truncated -0.5

`arith_correct_strict` / `arith_correct_lenient` are plain bool checkers (boxed form vs last number).
Run: python -c "from areal_mq.rewards.arith import arith_reward; print(arith_reward('', '\\boxed{4}', 4))"
"""
from __future__ import annotations

from .formats import find_boxes, last_number, normalize_reference, parse_int, repetition_reason

_TRAILING_NOISE = " \t\r\n.$*)]}\\"


def reference_int(reference) -> int:
    """The reference answer as an int (numbers, '42', '1,000', GSM8K '#### 42'); ValueError otherwise."""
    value = parse_int(normalize_reference(reference))
    if value is None:
        raise ValueError(f"arith needs an integer reference answer, got {reference!r}")
    return value


def _single_box(completion: str) -> tuple[str, int | None, int]:
    """(reason, boxed integer or None, end of the box) for the strict form checks."""
    boxes = find_boxes(completion)
    if boxes.unclosed:
        return "malformed_box", None, -1
    if not boxes.contents:
        return "no_box", None, -1
    if len(boxes.contents) > 1:
        return "multiple_boxes", None, -1
    value = parse_int(boxes.contents[0])
    return ("ok" if value is not None else "not_integer"), value, boxes.last_end


def arith_correct_strict(completion: str, reference) -> bool:
    r"""Exactly one well-formed `\boxed{N}` and N equals the reference (truncation/repetition ignored)."""
    reason, value, _ = _single_box(completion)
    return reason == "ok" and value == reference_int(reference)


def arith_correct_lenient(completion: str, reference) -> bool:
    """The last number anywhere in the text equals the reference."""
    last = last_number(completion)
    if last is None:
        return False
    try:
        return float(last) == float(reference_int(reference))
    except ValueError:
        return False


def arith_reward(prompt: str, completion: str, reference, *, truncated: bool = False,
                 correct_reward: float = 1.0, wrong_reward: float = 0.0, no_answer_reward: float = 0.0,
                 penalty: float = -0.5, truncated_reward: float = -0.5, max_trailing_chars: int = 40,
                 lenient_correct_reward: float = 0.0, **meta) -> dict:
    """Reward of one `arith` completion; see the module docstring for the table."""
    gold = reference_int(reference)
    reason, value, end = _single_box(completion)
    if truncated:
        reason = "truncated"
    elif reason == "ok":
        degenerate = repetition_reason(completion)
        trailing = completion[end:].strip(_TRAILING_NOISE)
        if degenerate:
            reason = "repetition"
        elif len(trailing) > max_trailing_chars:
            reason = "box_not_final"
        else:
            reason = "correct" if value == gold else "wrong"
    if reason == "no_box" and lenient_correct_reward and arith_correct_lenient(completion, gold):
        reason = "unboxed_correct"  # shaping: right number, wrong form (worth something while boxing is rare)
    rewards = {
        "unboxed_correct": lenient_correct_reward,
        "correct": correct_reward, "wrong": wrong_reward, "not_integer": no_answer_reward,
        "box_not_final": wrong_reward, "no_box": no_answer_reward, "truncated": truncated_reward,
    }
    return {
        "reward": rewards.get(reason, penalty),
        "correct": reason == "correct",
        "reason": reason,
        "answer": value,
    }
