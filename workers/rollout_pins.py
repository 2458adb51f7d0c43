"""The rollout worker's pinned requests (GenerateRequest.pin_version): which run, and whether they hold updates back.

What: a periodic evaluation through the rollout engines (eval.via rollout, workers/controller_eval.py) pins each of
its requests to the version it evaluates. The worker (workers/rollout.py) starts a pinned request only at exactly
that version, and while pinned requests run it applies no newer version (it fetches it, then waits), so every token
of a pinned answer carries the pinned version. Training requests meanwhile are generated at that version too: that
is the cost, a few more versions of staleness for the samples generated during an evaluation.
Why a linger: the job broker gives a worker its next request when the worker answers one (credits), a round trip
later. Without the linger an update would slip into the gap between the last pinned answer and the next pinned
request, and that request would be refused (version_passed), skipping the whole evaluation.
The bound: an update waits at most `limit_s`, from the first time it found pinned requests in its way: the generate
lease (the broker's own limit on one answer) times the waves of an evaluation on one engine (eval.size x
eval.samples requests over rollout.engine.max_concurrent rows). Past it the update is applied anyway (logged as
rollout.pin_hold_expired); the pinned answers then carry two versions and the controller skips that evaluation,
never reporting a number of mixed weights.
"""
from __future__ import annotations

import math
from typing import Any, Callable

PIN_LINGER_S = 1.0  # after the last pinned answer: covers the broker's round trip to the next pinned request


def pin_hold_limit_s(cfg: Any) -> float:
    """The longest a ready update waits for pinned requests (see the module docstring for the arithmetic)."""
    lease = cfg.job_leases().get("generate") or cfg.generate_lease_floor_s
    waves = math.ceil(cfg.eval.size * cfg.eval.samples / max(1, cfg.rollout.engine.max_concurrent))
    return lease * max(1, waves) + PIN_LINGER_S


class PinnedRequests:
    """Pinned requests in the engine (job id -> version) and the hold they put on updates."""

    def __init__(self, limit_s: float, clock: Callable[[], float], linger_s: float = PIN_LINGER_S):
        self.limit_s, self.clock, self.linger_s = limit_s, clock, linger_s
        self.running: dict[str, int] = {}
        self.linger_until = float("-inf")
        self.waited_since: float | None = None  # when the update now waiting first found pinned requests in its way
        self.expired = False  # the bound was reached: the waiting update goes in (logged once by the caller)

    def started(self, job_id: str, version: int) -> None:
        self.running[job_id] = version

    def finished(self, job_id: str) -> None:
        if self.running.pop(job_id, None) is not None and not self.running:
            self.linger_until = self.clock() + self.linger_s

    def holding(self) -> bool:
        """Whether an update ready to apply must wait now: pinned requests run, or the linger after the last one has
        not passed, and it has not waited `limit_s` yet. Ask only when an update is waiting (starts its clock)."""
        now = self.clock()
        if not self.running and now >= self.linger_until:
            self.waited_since = None  # nothing holds: the next hold is timed afresh
            return False
        if self.waited_since is None:
            self.waited_since = now
        if now - self.waited_since > self.limit_s:
            self.expired = True
            return False
        return True

    def applied(self) -> None:
        """An update went in: the next one starts its own clock."""
        self.waited_since, self.expired = None, False
