"""DAPO's reward-side pieces (Yu et al. 2025, "DAPO", arXiv 2503.14476): soft overlong punishment and dynamic
sampling by outcome, as pure functions the controller (workers/controller.py) applies to a scored group.

What:
- `overlong_penalty(length, max_tokens, buffer, factor)`: DAPO eq. 13, the length-aware penalty added to an
  answer's reward: 0 up to max_tokens - buffer tokens, then falling linearly to -factor at max_tokens
  ((max_tokens - buffer) - length) / buffer x factor; -factor beyond (an answer the engine cut at the cap). Set by
  `controller.overlong_buffer` (the buffer, L_cache in the paper; 0 = off) and `controller.overlong_penalty`.
- `uniform_group(rewards, details, by)`: whether a group teaches nothing and dynamic sampling
  (`controller.drop_uniform_groups`) replaces it. by "reward": every reward equal (zero advantage whatever the
  estimator: today's rule, right for any reward). by "outcome": every answer's reward detail says the same
  `correct` (all right or all wrong: DAPO's rule for a verifiable reward, which still holds once rewards are shaped
  by length, as the overlong penalty shapes them); a group whose details do not all carry a boolean `correct` falls
  back to "reward" (stated in the controller's log as the reason).
Why pure: checked against the paper's numbers by hand (tests/unit/rewards/test_shaping.py).
"""
from __future__ import annotations

from typing import Any


def overlong_penalty(length: int, max_tokens: int, buffer: int, factor: float = 1.0) -> float:
    """DAPO eq. 13 (module docstring); 0 when buffer is 0."""
    if buffer <= 0:
        return 0.0
    start = max_tokens - buffer
    if length <= start:
        return 0.0
    if length <= max_tokens:
        return (start - length) / buffer * factor
    return -factor


def uniform_group(rewards: list[float], details: list[dict[str, Any]], by: str) -> tuple[bool, str]:
    """(is uniform, the rule that decided: "uniform_reward" / "uniform_outcome")."""
    if by == "outcome" and details and len(details) == len(rewards) and all(
            isinstance(d, dict) and isinstance(d.get("correct"), bool) for d in details):
        return len({d["correct"] for d in details}) == 1, "uniform_outcome"
    return max(rewards) - min(rewards) <= 1e-9, "uniform_reward"
