"""Chaos: kill -9 every role of a running system, one at a time, and audit that nothing was lost or trained twice.

A run of configs/tiny.yaml (60 steps, `launcher.on_child_death: restart`) is started with `areal-mq run`. At
random moments (seeded) the test kills -9 the rollout worker, the reward worker, the trainer, the controller
and the broker process, one after another, each only after the run made progress since the previous kill.
The launcher restarts each one. The run must reach `total_steps`, and an audit over the sample store's log
and the trainer's `trainer.step` events (which name the sample ids of each step) must show:
- no sample trained twice in the final lineage (a trainer resumed from a checkpoint redoes the versions after
  it: the last `trainer.step` of each version is the one that counts);
- every trained sample was stored, and every sample the store acknowledged as trained was trained;
- every sample the store dropped carries a reason;
- the controller's ledger balances: every admitted group left exactly once (stored, dropped, failed, stale)
  or is still in flight.
The time from each kill to its detection (the launcher's `launcher.child_restarted` event) and to recovered
progress (the next new trained version) is printed as a table (pytest -s shows it) and written to
run_dir/chaos.json.

Run: pytest tests/integration/test_chaos.py -q -m slow -s   (~3-5 min)
"""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from .procs import free_ports, wait_for

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
ROLES = ("rollout", "reward", "trainer", "controller", "broker")
STEPS = 60  # long enough that all five kills land before the run ends, whatever the seed


def _events(run_dir: Path, name: str | None = None) -> list[dict]:
    from areal_mq.telemetry.tail import read_events

    return read_events(run_dir, name)


def _trained_versions(run_dir: Path) -> set[int]:
    return {r["version"] for r in _events(run_dir, "trainer.step")}


def _live_pid(run_dir: Path, role: str) -> int:
    """The pid of the newest process of `role` that is alive (from its own events)."""
    for rec in reversed(_events(run_dir)):
        if rec.get("role") == role and "pid" in rec and os.path.exists(f"/proc/{rec['pid']}"):
            return int(rec["pid"])
    raise AssertionError(f"no live {role} process found in the events")


def _start(run_dir: Path, steps: int = STEPS, extra: tuple[str, ...] = ("launcher.max_restarts=3",
                                                                        "trainer.checkpoint_every=3")) -> subprocess.Popen:
    """`areal-mq run configs/tiny.yaml` on free broker ports, children restarted when they die; `extra`: more
    --set overrides (tests/integration/test_trainer_ranks.py adds a 2-rank trainer)."""
    job, bus_in, bus_out, store = free_ports(4)
    sets = [f"run.run_dir={run_dir}", f"brokers.job_port={job}", f"brokers.bus_in_port={bus_in}",
            f"brokers.bus_out_port={bus_out}", f"brokers.store_port={store}", "brokers.heartbeat_s=0.5",
            "brokers.liveness=4", "brokers.reconnect_max_s=2", f"controller.total_steps={steps}",
            "launcher.on_child_death=restart", "events.console=json", *extra]
    cmd = [sys.executable, "-m", "areal_mq.cli", "run", str(ROOT / "configs" / "tiny.yaml"), "--skip-eval", "--quiet",
           *[x for s in sets for x in ("--set", s)]]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL,
                            env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})


def _stop(proc: subprocess.Popen) -> None:
    """The run's end in a test's `finally`: SIGTERM (the launcher checkpoints and stops), then kill."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _kill_and_time(run_dir: Path, role: str) -> dict:
    pid = _live_pid(run_dir, role)
    before = max(_trained_versions(run_dir) | {0})
    t_kill = time.time()
    os.kill(pid, signal.SIGKILL)
    restarted = wait_for(lambda: [e for e in _events(run_dir, "launcher.child_restarted") if e["pid"] == pid],
                         60, interval=0.1, what=f"the launcher to restart the killed {role}")
    # recovered: a training step on a version this run had not reached before the kill
    recovered = wait_for(lambda: [e for e in _events(run_dir, "trainer.step") if e["ts"] > t_kill
                                  and e["version"] > before], 240, interval=0.2, what=f"progress after killing {role}")
    return {"role": role, "pid": pid, "detect_s": round(restarted[0]["ts"] - t_kill, 2),
            "recover_s": round(recovered[0]["ts"] - t_kill, 2), "version_at_kill": before}


def _store_log(run_dir: Path) -> dict[str, set]:
    """put / ack / drop sample ids from the store's own log (read with the store's replay code)."""
    from areal_mq.brokers.sample_store import SampleLog

    puts, acks, drops = set(), set(), {}
    from areal_mq import protocol

    for _offset, _nbytes, rec in SampleLog(run_dir / "store" / "samples.log").replay():
        if rec.get("op") == "put":
            puts.add(protocol.decode(rec["frames"]).msg.sample_id)
        elif rec.get("op") in ("ack", "done"):  # "done": acked or dropped ids kept by a compaction
            acks.update(rec["ids"])
        elif rec.get("op") == "drop":
            drops.update({sid: rec.get("reason") for sid in rec["ids"]})
    return {"put": puts, "ack": acks, "drop": drops}


def _audit(run_dir: Path, steps: int | None = None) -> None:
    steps = STEPS if steps is None else steps  # read at call time: test_netns_hosts sets STEPS to its own
    last_of_version: dict[int, dict] = {}
    for step in _events(run_dir, "trainer.step"):
        last_of_version[step["version"]] = step  # a resumed trainer redoes versions: the last one counts
    assert sorted(last_of_version) == list(range(1, steps + 1))
    trained = [sid for v in sorted(last_of_version) for sid in last_of_version[v]["sample_ids"]]
    assert len(trained) == len(set(trained)), "a sample was trained twice in the final lineage"
    log = _store_log(run_dir)
    assert set(trained) <= log["put"], "trained a sample the store never stored"
    assert log["ack"] <= set(trained), "the store acknowledged as trained a sample the final policy never saw"
    assert all(reason for reason in log["drop"].values()), "a dropped sample without a reason"
    assert not (set(trained) & set(log["drop"])), "a dropped sample was trained"
    finished = _events(run_dir, "controller.finished")
    assert finished and "ledger" in finished[-1], "the controller did not report its ledger"
    if finished:
        ledger = finished[-1]["ledger"]  # of the last controller process (stale ones were stored first)
        assert ledger["admitted"] == (ledger["stored"] + ledger["dropped_uniform"] + ledger["failed"]
                                      + ledger["in_flight"]), ledger


def test_chaos_kill_every_role_once(tmp_path):
    run_dir = tmp_path / "chaos"
    proc = _start(run_dir)
    timings = []
    try:
        wait_for(lambda: _trained_versions(run_dir) if (run_dir / "events").exists() else set(), 300,
                 interval=0.5, what="the first training step")
        rng = random.Random(int(os.environ.get("AREAL_CHAOS_SEED", "7")))
        order = list(ROLES)
        rng.shuffle(order)
        for role in order:
            time.sleep(rng.uniform(0.5, 3.0))
            assert max(_trained_versions(run_dir)) < STEPS - 2, "the run ended before every role was killed"
            timings.append(_kill_and_time(run_dir, role))
            assert proc.poll() is None, proc.stderr.read()[-3000:]
        _, err = proc.communicate(timeout=600)
    finally:
        _stop(proc)
    (run_dir / "chaos.json").write_text(json.dumps(timings, indent=1))
    print("\nrole        detect_s  recover_s  (killed at version)")
    for t in timings:
        print(f"{t['role']:<11} {t['detect_s']:>8.2f}  {t['recover_s']:>9.2f}  ({t['version_at_kill']})")
    assert proc.returncode == 0, err[-3000:]
    _audit(run_dir)
