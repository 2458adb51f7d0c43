r"""Math rewards on top of `math-verify`: answer equivalence, a format reward, a group length reward.

What: `math_equal("\frac{1}{2}", "0.5")` is True; `math_reward` pays 1.0 when the completion's final
answer (the last `\boxed{}`, else the last expression in the text) equals the reference, which may be
LaTeX, a number or a GSM8K solution ending in `#### N`. `format_reward` pays for exactly one non-empty
well-formed `\boxed{}` (the form half of the strict verdict, areal_mq.grading); combine both with
`TaskConfig.combine` to weight them. `math_concise` is a group
reward: correct answers shorter than their group's others earn more.
Why math-verify: it normalizes LaTeX, fractions, percentages, thousands separators and sets far more
robustly than string matching. Its timeouts use signal.alarm, which only works in a main thread, so
off the main thread we call it without them (the executor's per-call deadline still applies). It is
imported at module import (~1 s, sympy) so pool processes pay for it while warming up, not in a call.

Run: python -c "from areal_mq.rewards.math_rewards import math_equal; print(math_equal('1,000', '1000'))"
"""
from __future__ import annotations

import threading

from math_verify import parse, verify

from areal_mq.grading import find_boxes, normalize_reference, strict_answer
from areal_mq.rewards.registry import group_reward


def _timeout() -> int | None:
    return 5 if threading.current_thread() is threading.main_thread() else None


def parse_gold(reference) -> list:
    """math-verify's parse of a reference answer; plain answers are read as LaTeX math ('$...$')."""
    text = normalize_reference(reference)
    tmo = _timeout()
    wrapped = text if ("$" in text or "\\boxed" in text or "\\(" in text) else f"${text}$"
    gold = parse(wrapped, parsing_timeout=tmo)
    return gold or parse(text, parsing_timeout=tmo)


def parse_prediction(completion: str) -> list:
    r"""math-verify's parse of a completion: the last `\boxed{}` first, else the last expression."""
    return parse(completion, parsing_timeout=_timeout())


def math_equal(prediction: str, reference) -> bool:
    r"""True when the final answer of `prediction` equals `reference` mathematically.

    '\boxed{\frac{1}{2}}' vs '0.5' -> True; '1,000' vs 1000 -> True; 'no answer' vs '5' -> False.
    """
    gold = parse_gold(reference)
    if not gold:
        raise ValueError(f"could not parse the reference answer {reference!r}; give a number or LaTeX math")
    pred = parse_prediction(prediction)
    if not pred:
        return False
    return bool(verify(gold, pred, timeout_seconds=_timeout()))


def math_reward(prompt: str, completion: str, reference, **meta) -> dict:
    """1.0 when the completion's final answer equals the reference (math-verify), else 0.0."""
    gold = parse_gold(reference)
    if not gold:
        raise ValueError(f"could not parse the reference answer {reference!r}; give a number or LaTeX math")
    pred = parse_prediction(completion)
    correct = bool(pred) and bool(verify(gold, pred, timeout_seconds=_timeout()))
    return {
        "reward": 1.0 if correct else 0.0,
        "correct": correct,
        "answer": str(pred[-1]) if pred else None,
        "boxed": len(find_boxes(completion).contents),
    }


def format_reward(prompt: str, completion: str, reference=None, **meta) -> dict:
    r"""1.0 when the completion holds exactly one non-empty, well-formed `\boxed{}` and no unclosed one."""
    reason = strict_answer(completion).form  # the form half of the strict verdict (areal_mq.grading)
    return {"reward": 1.0 if reason == "ok" else 0.0, "format": reason}


@group_reward
def math_concise(prompt: str, completions: list[str], reference, *, length_weight: float = 0.5,
                 **meta) -> list[dict]:
    """Group reward: correct answers get 1 - length_weight * (how much longer than the group's shortest
    correct answer, scaled to 0..1 over the group); wrong answers get 0."""
    correct = [math_equal(c, reference) for c in completions]
    lengths = [len(c) for c in completions]
    ok_lengths = [n for n, ok in zip(lengths, correct) if ok]
    lo, hi = (min(ok_lengths), max(ok_lengths)) if ok_lengths else (0, 0)
    out = []
    for n, ok in zip(lengths, correct):
        rel = (n - lo) / (hi - lo) if ok and hi > lo else 0.0
        out.append({"reward": (1.0 - length_weight * rel) if ok else 0.0, "correct": ok})
    return out
