"""Reward functions the reward-worker integration tests load by import path in real worker processes."""
import os
import time


def slow(prompt, completion, reference, *, log_path, delay_s=0.4, **meta):
    """Takes `delay_s`, and logs 'start <completion> <pid> <ppid>' first so a test can kill mid-job."""
    with open(log_path, "a") as f:
        f.write(f"start {completion} {os.getpid()} {os.getppid()}\n")
    time.sleep(delay_s)
    return float(len(completion))


def length(prompt, completion, reference, **meta):
    return float(len(completion))


def broken(prompt, completion, reference, **meta):
    raise RuntimeError(f"reward service bug on {completion!r}")
