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

import math_verify  # noqa: F401 - imported here so a reward pool process pays for sympy while it warms up

from areal_mq.grading import find_boxes, grade, parse_gold, strict_answer
from areal_mq.rewards.registry import group_reward


def _check_reference(reference) -> None:
    if not parse_gold(reference):
        raise ValueError(f"could not parse the reference answer {reference!r}; give a number or LaTeX math")


def math_equal(prediction: str, reference) -> bool:
    r"""True when the final answer of `prediction` equals `reference` mathematically: the lenient verdict of
    the one grader (areal_mq.grading.grade), which held-out evaluation reports too.

    '\boxed{\frac{1}{2}}' vs '0.5' -> True; '1,000' vs 1000 -> True; 'no answer' vs '5' -> False.
    """
    _check_reference(reference)
    return grade(prediction, reference).lenient


def math_reward(prompt: str, completion: str, reference, **meta) -> dict:
    """1.0 when the completion's final answer equals the reference (the grader's lenient verdict), else 0.0."""
    _check_reference(reference)
    verdict = grade(completion, reference)
    return {
        "reward": 1.0 if verdict.lenient else 0.0,
        "correct": verdict.lenient,
        "answer": verdict.lenient_answer,
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
