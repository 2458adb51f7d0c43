"""Reward functions the executor tests run in pool processes (importable, so spawn can load them)."""
import os
import signal
import time

from areal_mq.rewards.registry import group_reward


def length(prompt, completion, reference, **meta):
    return float(len(completion))


def counted(prompt, completion, reference, *, log_path, truncated=False, **meta):
    """Appends one line per call to `log_path`, so tests can count real calls (cache, idempotency)."""
    with open(log_path, "a") as f:
        f.write(f"{completion}\n")
    return {"reward": 1.0 if completion == reference else 0.0, "truncated": truncated}


def raises(prompt, completion, reference, **meta):
    raise ZeroDivisionError(f"boom on {completion!r}")


def hangs(prompt, completion, reference, **meta):
    if completion == "fast":
        return 0.5
    time.sleep(3600)


def exits(prompt, completion, reference, **meta):
    os._exit(7)


def killed(prompt, completion, reference, **meta):
    os.kill(os.getpid(), signal.SIGKILL)


def flaky(prompt, completion, reference, *, marker, **meta):
    """Fails the first time it sees `marker` (a file path), succeeds afterwards."""
    if not os.path.exists(marker):
        open(marker, "w").close()
        raise ConnectionError("transient failure")
    return 2.0


def bad_type(prompt, completion, reference, **meta):
    return "high"


def narrow(prompt, completion, reference):
    """Takes no **meta: the executor must pass only what it declares."""
    return 3.0


@group_reward
def rank(prompt, completions, reference, **meta):
    """Relative reward: 1.0 for the longest completion of the group, 0.0 for the shortest."""
    order = sorted(range(len(completions)), key=lambda i: len(completions[i]))
    out = [0.0] * len(completions)
    for pos, i in enumerate(order):
        out[i] = pos / max(1, len(completions) - 1)
    return [{"reward": r, "group_size": len(completions)} for r in out]


@group_reward
def short_group(prompt, completions, reference, **meta):
    return [1.0]


def echo_limits(prompt, completion, reference, *, limit=1.0, **meta):
    """Reports the `limit` it was called with and what else reached **meta (tests of what a job may set)."""
    return {"reward": float(limit), "meta_keys": sorted(meta)}
