r"""The `arith` task reward used by the main training job: the strict verdict of areal_mq.grading, plus
penalties for the ways a policy games it.

What: `arith_reward` pays `correct_reward` only when the completion is strictly correct (EXACTLY ONE
well-formed `\boxed{N}`, N equal to the reference; areal_mq.grading) and the box is near the end of the
text, the completion is not truncated and not degenerate.
Why so strict: a peer's GRPO run (TRL) learned to box the answer and then repeat boxes until the length
cap; a reward that pays any correct box pays for that collapse. Here repeated boxes, unclosed boxes and
repeated lines earn `penalty`, a truncated completion (RewardJob.truncated) earns `truncated_reward`.

    reason          reward (defaults)
    correct         1.0   exactly one final \boxed{N}, N == reference
    wrong           0.0   one well-formed box with a wrong number, or followed by too much text (box_not_final)
    not_a_number    0.0   (no_answer_reward) a box without a plain number, e.g. a copied literal \boxed{N};
                          empty_box likewise
    no_box          0.0   (unboxed_correct: the lenient answer is right but unboxed -> lenient_correct_reward,
                           0 by default; worth paying while the base model boxes ~2% of the time)
    multiple_boxes -0.5   unclosed_box -0.5   repetition -0.5   truncated -0.5

Run: python -c "from areal_mq.rewards.arith_reward import arith_reward; print(arith_reward('', '\\boxed{4}', 4))"
"""
from __future__ import annotations

import zlib

from areal_mq.grading import canonical_number, lenient_answer, normalize_reference, numbers_equal, strict_answer

_TRAILING_NOISE = " \t\r\n.$*)]}\\"


def reference_int(reference) -> int:
    """The reference answer as an int (numbers, '42', '1,000', GSM8K '#### 42'); ValueError otherwise."""
    value = canonical_number(normalize_reference(reference))
    if value is None or not value.lstrip("-").isdigit():
        raise ValueError(f"arith needs an integer reference answer, got {reference!r}")
    return int(value)


def arith_reward(prompt: str, completion: str, reference, *, truncated: bool = False,
                 correct_reward: float = 1.0, wrong_reward: float = 0.0, no_answer_reward: float = 0.0,
                 penalty: float = -0.5, truncated_reward: float = -0.5, max_trailing_chars: int = 40,
                 lenient_correct_reward: float = 0.0, **meta) -> dict:
    """Reward of one `arith` completion; see the module docstring for the table."""
    gold = reference_int(reference)
    answer = strict_answer(completion)
    reason = "not_a_number" if answer.form == "ok" and answer.value is None else answer.form
    if truncated:
        reason = "truncated"
    elif reason == "ok":
        degenerate = repetition_reason(completion)
        trailing = completion[answer.end:].strip(_TRAILING_NOISE)
        if degenerate:
            reason = "repetition"
        elif len(trailing) > max_trailing_chars:
            reason = "box_not_final"
        else:
            reason = "correct" if numbers_equal(answer.value, gold) else "wrong"
    if reason == "no_box" and lenient_correct_reward and numbers_equal(lenient_answer(completion), gold):
        reason = "unboxed_correct"  # shaping: right number, wrong form (worth something while boxing is rare)
    rewards = {
        "unboxed_correct": lenient_correct_reward,
        "correct": correct_reward, "wrong": wrong_reward, "not_a_number": no_answer_reward,
        "empty_box": no_answer_reward, "box_not_final": wrong_reward, "no_box": no_answer_reward,
        "truncated": truncated_reward,
    }
    return {
        "reward": rewards.get(reason, penalty),
        "correct": reason == "correct",
        "reason": reason,
        "answer": answer.value,
    }


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
