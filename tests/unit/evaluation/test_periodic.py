"""Periodic evaluation: which versions are due, and pinning a version so pruning cannot change what is read."""
from __future__ import annotations

from pathlib import Path

from areal_mq.evaluation.periodic import PeriodicEval, due_versions, pin_version
from areal_mq.weights import prune_disk


def test_due_versions_multiples_before_the_final_one():
    assert due_versions([1, 2, 3, 4, 5, 6], every=2, last_step=6, done=set()) == [2, 4]
    assert due_versions([2, 4], every=2, last_step=6, done={2}) == [4]
    assert due_versions([0, 3, 6, 9], every=3, last_step=9, done=set()) == [3, 6]  # v0 is the base model's row
    assert due_versions([1, 2, 3], every=0, last_step=3, done=set()) == []


def _publish(root: Path, version: int, payload: bytes) -> Path:
    d = root / f"v{version}"
    d.mkdir(parents=True)
    (d / "model.safetensors").write_bytes(payload)
    (d / "config.json").write_text("{}")
    return d


def test_pinned_version_survives_pruning(tmp_path):
    weights, pins = tmp_path / "weights", tmp_path / "eval_pins"
    src = _publish(weights, 2, b"version-two")
    pinned = pin_version(src, pins)
    for v in (3, 4):
        _publish(weights, v, b"later")
    prune_disk(weights, keep=2)
    assert not src.exists()
    assert (pinned / "model.safetensors").read_bytes() == b"version-two"
    assert sorted(p.name for p in pinned.iterdir()) == ["config.json", "model.safetensors"]


def test_pin_of_a_pruned_version_is_none(tmp_path):
    assert pin_version(tmp_path / "weights" / "v7", tmp_path / "eval_pins") is None


def test_poll_without_due_versions_starts_nothing(tmp_path):
    ev = PeriodicEval(tmp_path / "config.yaml", tmp_path, every=5, last_step=20)
    _publish(tmp_path / "weights", 4, b"x")
    assert ev.poll() is None and ev.proc is None
    ev.stop()  # nothing running: a no-op


def test_a_resumed_run_does_not_evaluate_recorded_versions_again(tmp_path):
    from areal_mq.config import load_config

    (tmp_path / "eval.jsonl").write_text('{"version": 0}\n{"version": 10}\nnot json\n')
    cfg = load_config(None, [f"run.run_dir={tmp_path}", "eval.every=10", "controller.total_steps=30"])
    ev = PeriodicEval.from_config(cfg, tmp_path / "config.yaml")
    assert ev.done == {0, 10}
    assert due_versions([10, 20], ev.every, ev.last_step, ev.done) == [20]


def test_two_due_versions_at_the_first_poll_evaluate_the_newest_and_record_the_other(tmp_path):
    # regression: the skipped-versions log was written before eval_pins/ existed
    for v in (10, 20):
        _publish(tmp_path / "weights", v, b"w")
    ev = PeriodicEval(tmp_path / "missing-config.yaml", tmp_path, every=10, last_step=30)
    try:
        assert "evaluating v20" in ev.poll()
        assert ev.current == 20 and ev.done == {10, 20}
        assert "skipped [10]" in (tmp_path / "eval_pins" / "skipped.txt").read_text()
    finally:
        ev.stop()  # the eval process (it fails on the missing config) is stopped and reaped
    assert ev.proc is None and not (tmp_path / "eval_pins" / "v20").exists()
