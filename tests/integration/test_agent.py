"""The agent role end to end (slow): `areal-mq run` with agent.workflow on the tiny model, real brokers, rollout,
trainer, controller and agent processes.

- multi_turn_retry trains: episodes of two turns reach the store as one sequence each and the trainer steps on
  them (only the generated tokens: n_gen_tokens counts mask-1 tokens);
- single and tool_calc run end to end (the run completes; every stored group is a group of episodes);
- an agent killed with SIGKILL mid-episode loses only its episodes: the job broker requeues them to the other
  agent (broker.worker_removed requeued > 0), the run still reaches total_steps and the admission ledger
  balances (admitted = stored + dropped_uniform + failed + in_flight);
- a bad --workflow is a clear CLI error (exit 2), before any socket is opened.
Run: pytest -m slow tests/integration/test_agent.py
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from .procs import wait_for
from .test_e2e import ROOT, _events, _sets

pytestmark = pytest.mark.slow


def _start(run_dir: Path, *extra: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "areal_mq.cli", "run", str(ROOT / "configs" / "tiny.yaml"), "--skip-eval",
           "--quiet", *_sets(run_dir, *extra)]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL)


def _finish(proc: subprocess.Popen, timeout: float) -> tuple[int, str]:
    try:
        _, err = proc.communicate(timeout=timeout)
        return proc.returncode, err
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)  # the launcher stops its children by PID
        try:
            _, err = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            _, err = proc.communicate()
        return -1, f"no end after {timeout} s\n{err[-3000:]}"


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_multi_turn_retry_run_trains_on_episodes(tmp_path):
    run_dir = tmp_path / "mt"
    code, err = _finish(_start(run_dir, "agent.workflow=multi_turn_retry", "agent.workflow_args={attempts: 2}",
                               "controller.total_steps=4"), timeout=400)
    assert code == 0, err[-3000:]
    assert [m["version"] for m in _metrics(run_dir)] == [1, 2, 3, 4]
    done = _events(run_dir, "agent.episode_done")
    assert done and any(e["turns"] == 2 for e in done), "no episode took a second attempt"
    assert all(e["turns"] <= 2 for e in done)
    for m in _metrics(run_dir):  # feedback tokens are in the sequences but not in the loss
        assert m["n_gen_tokens"] < m["n_tokens"]
    assert not _events(run_dir, "agent.episode_failed")


@pytest.mark.parametrize("workflow", ["single", "tool_calc"])
def test_builtin_workflows_run_end_to_end(tmp_path, workflow):
    run_dir = tmp_path / workflow
    code, err = _finish(_start(run_dir, f"agent.workflow={workflow}", "controller.total_steps=2"), timeout=400)
    assert code == 0, err[-3000:]
    assert [m["version"] for m in _metrics(run_dir)] == [1, 2]
    done = _events(run_dir, "agent.episode_done")
    assert done and all(e["turns"] >= 1 for e in done)
    if workflow == "single":
        assert all(e["turns"] == 1 for e in done)


def _agent_pid(run_dir: Path, name: str) -> int | None:
    """PID of the agent process `name` of this run (its command line names the run's config and worker id)."""
    config = str(run_dir / "config.yaml")
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            args = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if config.encode() in args and name.encode() in args and b"agent" in args:
            return int(entry)
    return None


def test_an_agent_killed_mid_episode_loses_only_its_episodes(tmp_path):
    run_dir = tmp_path / "kill"
    # slow decoding (>= 40 ms a step, a test knob) keeps episodes in flight for seconds; two agents
    proc = _start(run_dir, "agent.workflow=multi_turn_retry", "launcher.agent_workers=2", "agent.max_episodes=4",
                  "controller.total_steps=4", "rollout.engine.step_delay_s=0.04", "launcher.on_child_death=restart")
    try:
        wait_for(lambda: any(e.get("worker_id") == "agent-0" for e in _events(run_dir, "agent.episode_done")),
                 timeout=240, what="agent-0 finished an episode")
        pid = _agent_pid(run_dir, "agent-0")
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
    finally:
        code, err = _finish(proc, timeout=400)
    assert code == 0, err[-3000:]
    assert [m["version"] for m in _metrics(run_dir)] == [1, 2, 3, 4]
    removed = [e for e in _events(run_dir, "broker.worker_removed") if e["worker"] == "agent-0"]
    assert removed and removed[0]["requeued"] > 0, "agent-0 held no episode when it was killed"
    assert not _events(run_dir, "controller.group_failed")  # requeued to the other agent, not lost
    (final,) = _events(run_dir, "controller.finished")
    ledger = final["ledger"]
    assert ledger["admitted"] == ledger["stored"] + ledger["dropped_uniform"] + ledger["failed"] + ledger["in_flight"]


def test_a_bad_workflow_spec_is_a_clear_cli_error(tmp_path):
    for spec, why in [("no_such_module_q:episode", "cannot import"), ("justaname", "built-in")]:
        done = subprocess.run([sys.executable, "-m", "areal_mq.cli", "worker", "agent", "--workflow", spec,
                               "--insecure"], capture_output=True, text=True, timeout=120, cwd=tmp_path)
        assert done.returncode == 2 and why in done.stderr, done.stderr[-2000:]
    done = subprocess.run([sys.executable, "-m", "areal_mq.cli", "worker", "reward", "--workflow", "single"],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 2 and "agent role" in done.stderr
