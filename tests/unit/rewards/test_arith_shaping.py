r"""Shaping of the arith reward used by the quickstart: partial credit for a right but unboxed number
(off by default), never for degenerate or truncated completions."""
from areal_mq.rewards.arith_reward import arith_reward

SHAPED = {"wrong_reward": 0.25, "lenient_correct_reward": 0.25}


def test_unboxed_correct_is_paid_only_when_configured():
    assert arith_reward("", "3 + 4 = 7", 7)["reward"] == 0.0
    got = arith_reward("", "3 + 4 = 7", 7, **SHAPED)
    assert got["reason"] == "unboxed_correct" and got["reward"] == 0.25
    assert arith_reward("", "3 + 4 = 8", 7, **SHAPED)["reward"] == 0.0


def test_shaping_never_pays_for_collapse():
    assert arith_reward("", r"\boxed{7} \boxed{7} \boxed{7}", 7, **SHAPED)["reward"] < 0
    assert arith_reward("", "3 + 4 = 7", 7, truncated=True, **SHAPED)["reward"] < 0
    assert arith_reward("", r"so \boxed{7}", 7, **SHAPED)["reward"] == 1.0
    assert arith_reward("", r"so \boxed{9}", 7, **SHAPED)["reward"] == 0.25
