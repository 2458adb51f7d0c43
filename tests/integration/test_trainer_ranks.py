"""`launcher.trainer_ranks: 2` with `trainer.strategy: fsdp`: `areal-mq run` starts a 2-rank sharded trainer
(torch.distributed.run, gloo) beside the other roles, from one command, publishing its weights sharded (each
rank serves its own slices over zmq, the rollout worker assembles them: trainer.publish_layout auto), each process
seeing exactly the GPUs its placement names (read from /proc/PID/environ); kill -9 of the rank that does not talk
to the brokers (rank 1) takes the unit down, the launcher restarts it, it resumes from its last sharded
checkpoint and the run reaches its last version, with the chaos test's audit: nothing trained twice in the
final lineage, nothing acked that the final policy never saw, nothing trained that was never stored.
Run: pytest tests/integration/test_trainer_ranks.py -q -m slow   (~2-3 min on 2 cores)
"""
from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from .procs import wait_for
from .test_chaos import _audit, _events, _start, _stop, _trained_versions

pytestmark = pytest.mark.slow
STEPS = 12


def _children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(entry))
    return out


def _visible(pid: int) -> str | None:
    """CUDA_VISIBLE_DEVICES in the environment of process `pid`."""
    for item in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
        if item.startswith(b"CUDA_VISIBLE_DEVICES="):
            return item.split(b"=", 1)[1].decode()
    return None


def _rank1_pid(run_dir: Path) -> tuple[int, int]:
    """(rank 0's pid from its trainer.started event, the pid of its sibling rank under the same torchrun)."""
    started = _events(run_dir, "trainer.started")[-1]
    assert started["world_size"] == 2, started
    rank0 = int(started["pid"])
    agent = int(Path(f"/proc/{rank0}/stat").read_text().rsplit(")", 1)[1].split()[1])
    others = [p for p in _children(agent) if p != rank0]
    assert len(others) == 1, (agent, others)
    return rank0, others[0]


def test_two_fsdp_ranks_under_the_launcher_survive_a_killed_rank(tmp_path):
    run_dir = tmp_path / "ranks"
    proc = _start(run_dir, STEPS, ("launcher.max_restarts=2", "trainer.checkpoint_every=2",
                                   "trainer.strategy=fsdp", "launcher.trainer_ranks=2", "trainer.publish_mode=zmq",
                                   "placement.trainer.gpus=[0,1]", "placement.rollout.gpus=[2]"))
    try:
        wait_for(lambda: (run_dir / "checkpoints" / "step00000002").is_dir() and _trained_versions(run_dir)
                 if (run_dir / "events").exists() else False, 400, interval=0.5, what="checkpoint 2")
        assert max(_trained_versions(run_dir)) < STEPS - 1, "the run ended before the kill"
        assert (run_dir / "checkpoints" / "step00000002" / "sharded").is_dir()  # each rank wrote its shards
        rank0, rank1 = _rank1_pid(run_dir)
        # placement: each process sees exactly its GPUs (the names are just indices on this GPU-less machine)
        assert _visible(rank0) == _visible(rank1) == "0,1"
        rollout = [e["pid"] for e in _events(run_dir) if e.get("role") == "rollout" and "pid" in e][-1]
        assert _visible(rollout) == "2"
        os.kill(rank1, signal.SIGKILL)
        wait_for(lambda: [e for e in _events(run_dir, "trainer.started") if e["pid"] != rank0], 300,
                 interval=0.5, what="the trainer unit restarted")
        _, err = proc.communicate(timeout=600)
    finally:
        _stop(proc)
    assert proc.returncode == 0, err[-3000:]
    restarted = _events(run_dir, "trainer.started")[-1]
    assert restarted["world_size"] == 2 and restarted["version"] >= 2  # resumed from a checkpoint, not from 0
    assert _events(run_dir, "launcher.child_restarted")
    # fsdp + zmq publishes sharded by default: each rank served its own slices, the rollout worker assembled them
    sharded = _events(run_dir, "trainer.published_sharded")
    assert sharded and {e["ranks"] for e in sharded} == {2}, sharded[:3]
    updated = [e for e in _events(run_dir, "rollout.weights_updated") if e.get("mode") == "zmq"]
    assert max(e["version"] for e in updated) >= STEPS - 2, [e["version"] for e in updated]
    _audit(run_dir, STEPS)
