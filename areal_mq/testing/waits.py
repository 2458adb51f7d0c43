"""wait_for: wait on a condition, not a fixed sleep (a loaded 2-core machine makes any fixed sleep too short).

    from areal_mq.testing import wait_for
    wait_for(lambda: worker_count(cfg, "echo") == 1, 30, what="the echo worker")   # returns the truthy value
"""
from __future__ import annotations

import time
from typing import Callable, TypeVar

T = TypeVar("T")


def wait_for(predicate: Callable[[], T], timeout: float, interval: float = 0.05, what: str = "condition") -> T:
    """Call `predicate` every `interval` s until it returns something truthy (returned); AssertionError naming
    `what` after `timeout` s. The predicate is tried once more at the deadline, so a slow first call still counts.
    interval 0: the predicate waits by itself (e.g. a receive with a timeout), so no sleep between calls."""
    if timeout <= 0 or interval < 0:
        raise ValueError(f"wait_for needs a positive timeout and an interval >= 0, got {timeout} and {interval}")
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        if interval:
            time.sleep(interval)
