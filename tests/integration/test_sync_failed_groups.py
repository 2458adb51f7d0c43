"""A synchronous run (η = 0) whose reward task fails for some prompts still trains to total_steps.

Before the admission ledger, a group that failed after max_retries kept its place in the staleness bound
forever: with η = 0 one failed group closed admission and the trainer waited forever for a batch. Here the
reward function raises for about a third of the prompts (tests/integration/failing_reward.py), with no
reward retries and no controller retries, so those groups fail (slow: the whole system via `areal-mq run`).
Run: pytest -m slow tests/integration/test_sync_failed_groups.py
"""
from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from .test_e2e import ROOT, _events, _sets

pytestmark = pytest.mark.slow
REWARD = f"{Path(__file__).with_name('failing_reward.py')}:fails_for_some"


def _run_or_stop(run_dir: Path, *extra: str, timeout: float) -> tuple[int, str]:
    """`areal-mq run` on tiny.yaml; past `timeout` (the deadlock this test is about) the launcher gets SIGTERM,
    so it stops its children (each in a session of its own) instead of leaving them running."""
    cmd = [sys.executable, "-m", "areal_mq.cli", "run", str(ROOT / "configs" / "tiny.yaml"), "--skip-eval",
           "--quiet", *_sets(run_dir, *extra)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL)
    try:
        _, err = proc.communicate(timeout=timeout)
        return proc.returncode, err
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)
        try:
            _, err = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            _, err = proc.communicate()
        return -1, f"no end after {timeout} s (deadlock?)\n{err[-3000:]}"


def test_sync_run_with_failing_reward_groups_reaches_total_steps(tmp_path):
    run_dir = tmp_path / "sync"
    code, err = _run_or_stop(run_dir, "run.mode=sync", f"controller.reward_task={REWARD}", "reward.retries=0",
                             "controller.max_retries=0", "controller.total_steps=4", timeout=240)
    assert code == 0, err[-3000:]
    failed = _events(run_dir, "controller.group_failed")
    assert failed, "no group failed: the test did not exercise the failure path"
    assert all("no completion could be scored" in e["reason"] for e in failed)
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [s["version"] for s in steps] == [1, 2, 3, 4]
