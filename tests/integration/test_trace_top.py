"""`areal-mq trace` on a real run's events and `areal-mq top --once` against a running job (slow: real processes).

- trace: a tiny `areal-mq run` at events.level=debug; one trained group's timeline has its admitted, generated,
  reward, stored, leased and trained lines in that order, the trained line naming the trainer step's version;
  an unknown id is a clear error (exit 2) that lists real ids.
- top: brokers and one slow echo worker (capacity 1) with five jobs submitted: the frame shows the queue depth
  of the echo service and the worker, busy 1/1.
Run: pytest -m slow tests/integration/test_trace_top.py
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from areal_mq.client import JobClient
from areal_mq.messages import RewardJob

from .conftest import keys, wait_for, worker_count
from .test_e2e import _events, _run

pytestmark = pytest.mark.slow


def _cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "areal_mq.cli", *args], capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL, env={**os.environ, "COLUMNS": "200"})


def test_trace_shows_a_trained_groups_journey_in_order(tmp_path):
    run_dir = tmp_path / "run"
    done = _run(run_dir, "controller.total_steps=2", "events.level=debug")
    assert done.returncode == 0, done.stderr[-3000:]
    step = _events(run_dir, "trainer.step")[-1]
    group = step["sample_ids"][0]

    shown = _cli("trace", str(run_dir), group, "--json")
    assert shown.returncode == 0, shown.stderr
    timeline = json.loads(shown.stdout)
    stages = [s["stage"] for s in timeline["steps"]]
    order = ["admitted", "generated", "reward", "stored", "leased", "trained"]
    assert [s for s in stages if s in order] == sorted([s for s in stages if s in order], key=order.index)
    assert set(order) <= set(stages), stages
    trained = next(s for s in timeline["steps"] if s["stage"] == "trained")["detail"]
    assert trained["version"] == step["version"] and trained["policy"] == step["version"] - 1
    assert trained["staleness"]["tokens"] > 0
    reward = next(s for s in timeline["steps"] if s["stage"] == "reward")["detail"]
    assert len(reward["completions"]) == 2  # tiny.yaml's group_size
    assert timeline["seqs"] and timeline["missing"] == []

    text = _cli("trace", str(run_dir), f"{group}-e1")
    assert text.returncode == 0, text.stderr
    at = [text.stdout.index(f" {stage} ") for stage in order]
    assert at == sorted(at), text.stdout
    assert f"step -> v{step['version']}" in text.stdout

    bad = _cli("trace", str(run_dir), "g9999999-nope")
    assert bad.returncode == 2 and "groups that exist" in bad.stderr and group[:8] in bad.stderr


def test_top_once_shows_the_queue_and_the_worker(broker, procs, config_path, cfg):
    procs.start(["worker", "echo", "--config", str(config_path), "--worker-id", "echo-slow"], "echo",
                {"AREAL_ECHO_DELAY_S": "60", "AREAL_ECHO_CAPACITY": "1"})
    wait_for(lambda: worker_count(cfg, "echo") == 1, 30, what="the echo worker")
    client = JobClient(cfg.brokers.job_addr, keys=keys(cfg, "controller"), heartbeat_s=0.2)
    try:
        for i in range(5):
            client.submit(RewardJob(task="t", completions=["x" * (i + 1)]), service="echo")

        def queued() -> bool:
            stats = client.stats(5)
            return stats["queued"].get("echo") == 4 and stats["in_flight"] == 1

        wait_for(queued, 30, what="4 queued and 1 in flight")
        frame = _cli("top", str(config_path), "--once", "--listen", "0.5")
        assert frame.returncode == 0, frame.stderr
        assert "echo 4" in frame.stdout and "in flight 1" in frame.stdout, frame.stdout
        row = next(line for line in frame.stdout.splitlines() if "echo-slow" in line)
        assert "1/1" in row and "yes" in row, frame.stdout
        assert "sample store" in frame.stdout and "unreachable" not in frame.stdout
    finally:
        client.close()


def test_top_names_a_missing_run_config(tmp_path):
    gone = _cli("top", str(tmp_path), "--once")
    assert gone.returncode == 2 and "no config.yaml" in gone.stderr
