"""The soak's nemesis signals a role's process that may be gone by then (benchmarks/faults/soak.py): the first 60-minute
soak ended at minute 46 on a ProcessLookupError when a role's process exited between the lookup and the kill."""
from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "benchmarks"), str(ROOT / "benchmarks" / "faults")]  # common.py; the soak modules

import soak  # noqa: E402


def test_a_process_gone_before_the_signal_is_looked_up_again_not_raised(tmp_path):
    gone = subprocess.Popen(["sleep", "0"])
    gone.wait()
    assert soak._signal_role(tmp_path, "trainer", gone.pid, signal.SIGKILL, tries=1) is None  # no new one: None


def test_a_live_process_gets_the_signal(tmp_path):
    live = subprocess.Popen(["sleep", "30"])
    try:
        assert soak._signal_role(tmp_path, "trainer", live.pid, signal.SIGKILL, tries=1) == live.pid
        assert live.wait(10) == -signal.SIGKILL
    finally:
        live.kill()


def test_the_audit_counts_a_compacted_sample_as_stored_and_a_summarized_drop_as_no_ack(tmp_path):
    """The 10-minute soak of 2026-11-28 reported 540 samples 'trained but never stored': a compaction had replaced
    their put records by one `done` record. The audit reads that record as stored, and not as an ack (a done id
    may have been dropped)."""
    from areal_mq import protocol
    from areal_mq.brokers.sample_log import SampleLog

    from tests.unit.brokers.test_sample_store import _sample

    log = SampleLog(tmp_path / "store" / "samples.log")
    log.append({"op": "done", "ids": ["s0", "s1"]})  # what a compaction writes for s0 (acked) and s1 (dropped)
    log.append_put(protocol.encode(_sample(2, 0)))
    log.append({"op": "ack", "ids": ["s2"]})
    log.close()
    seen = soak.store_log(tmp_path)
    assert seen["put"] == {"s2"} and seen["done"] == {"s0", "s1"} and seen["ack"] == {"s2"}


def test_the_checkpoint_shows_a_trained_version_whose_step_line_the_events_lost(tmp_path):
    """The second 60-minute soak (2026-11-28) lost two trainer.step lines under a full disk; the trainer's newest
    checkpoint still named those versions' samples. The audit reads both and says which source lacks what."""
    import json

    ckpt = tmp_path / "checkpoints" / "step00000003"
    ckpt.mkdir(parents=True)
    (ckpt / "trainer_state.json").write_text(json.dumps({"version": 3, "consumed_ids": ["a", "b", "c", "d", "e", "f"]}))
    steps = {1: ["a", "b"], 3: ["e", "f"], 4: ["g", "h"]}  # version 2's line lost; 4 trained after the checkpoint
    got = soak.checkpoint_audit(tmp_path, steps)
    assert got == {"checkpoint_version": 3, "checkpoint_consumed": 6, "checkpoint_trained_twice": 0,
                   "in_checkpoint_not_in_step_events": 2, "in_step_events_not_in_checkpoint": 0}
    (ckpt / "trainer_state.json").write_text(json.dumps({"version": 3, "consumed_ids": ["a", "b", "a", "e"]}))
    got = soak.checkpoint_audit(tmp_path, steps)
    assert got["checkpoint_trained_twice"] == 1 and got["in_step_events_not_in_checkpoint"] == 1  # "f"


def test_the_audit_reads_the_trained_ids_log_beside_the_checkpoints(tmp_path):
    """A checkpoint's JSON holds only its interval (issue 52 item 6); the audit reads the whole chain from
    checkpoints/trained_ids.jsonl up to the newest checkpoint's version."""
    import json

    ckpt = tmp_path / "checkpoints" / "step00000003"
    ckpt.mkdir(parents=True)
    (ckpt / "trainer_state.json").write_text(json.dumps({"version": 3, "consumed_ids": ["e", "f"]}))
    (tmp_path / "checkpoints" / "trained_ids.jsonl").write_text(
        json.dumps({"version": 1, "base": 0, "ids": ["a", "b"]}) + "\n"
        + json.dumps({"version": 3, "base": 1, "ids": ["c", "d", "e", "f"]}) + "\n")
    got = soak.checkpoint_audit(tmp_path, {1: ["a", "b"], 2: ["c", "d"], 3: ["e", "f"]})
    assert got == {"checkpoint_version": 3, "checkpoint_consumed": 6, "checkpoint_trained_twice": 0,
                   "in_checkpoint_not_in_step_events": 0, "in_step_events_not_in_checkpoint": 0}
