"""publish_mode zmq leaves no weights on disk, yet the held-out evaluation reads run_dir/weights/vN: the trainer
writes the versions it will evaluate (every eval.every-th and the last) there in full, exactly the published
policy, and nothing under disk publishing (whose versions are there already).

The real TrainerWorker and Trainer (tiny model) against a real in-process sample store.
"""
from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import zmq

from areal_mq.client import StoreClient
from areal_mq.config import RunConfig
from areal_mq.weights.delta import checksum
from areal_mq.weights.disk import disk_versions, read_disk
from areal_mq.workers.trainer import TrainerWorker
from tests.unit.algorithms.batches import make_samples
from tests.unit.brokers.test_sample_store import Running
from tests.unit.workers.test_trainer_resume import Null, trainer_cls  # noqa: F401 - the fixture


@pytest.mark.parametrize("mode", ["zmq", "disk"])
def test_the_versions_to_evaluate_are_on_disk_whatever_the_publish_mode(tmp_path, trainer_cls, mode):  # noqa: F811
    from areal_mq.engines.models import resolve_model

    cfg = RunConfig.model_validate({
        "run": {"run_dir": str(tmp_path / "run")}, "model": {"name": "tiny-random-llama"},
        "controller": {"batch_groups": 1, "max_staleness": 4, "total_steps": 3}, "eval": {"every": 2},
        "trainer": {"max_tokens_per_mb": 128, "publish_mode": mode, "publish_async": False}})
    (tmp_path / "run").mkdir()
    ctx = zmq.Context()
    run = Running(ctx, "inproc://evalw", tmp_path / "store")
    controller, store = StoreClient("inproc://evalw", ctx=ctx), StoreClient("inproc://evalw", ctx=ctx)
    try:
        for s in make_samples(5, n_groups=3, group_size=2, version=0, staleness=0):
            controller.put(s)
        worker = TrainerWorker(cfg, trainer_cls(cfg.trainer, resolve_model("tiny-random-llama")), store, Null(),
                               Null(), rt=None)
        worker.first_get = False
        for _ in range(3):
            worker.step(worker.next_batch(), 0.0)
        assert worker.trainer.version == 3
        weights = tmp_path / "run" / "weights"
        if mode == "disk":  # the publisher (a stand-in here) writes disk versions; nothing is added beside it
            assert not weights.exists()
            return
        assert disk_versions(weights) == [2, 3]  # v2 (eval.every) and v3 (the last); v1 never written
        held = read_disk(weights / "v3", verify_checksums=True)
        now = worker.trainer.publish_tensors()
        assert {k: checksum(t) for k, t in held.items()} == {k: checksum(t) for k, t in now.items()}
        assert (weights / "v3" / "config.json").is_file()  # loads with from_pretrained, as `areal-mq eval` does
    finally:
        controller.close()
        store.close()
        run.stop()
        ctx.term()


def test_a_full_disk_costs_the_evaluation_copy_not_the_run(tmp_path, trainer_cls, monkeypatch):  # noqa: F811
    import errno

    from areal_mq.engines.models import resolve_model
    from areal_mq.weights import publisher

    cfg = RunConfig.model_validate({
        "run": {"run_dir": str(tmp_path / "run")}, "model": {"name": "tiny-random-llama"},
        "controller": {"batch_groups": 1, "total_steps": 1}, "trainer": {"publish_mode": "zmq"}})
    (tmp_path / "run").mkdir()

    def full(*args, **kw):
        raise OSError(errno.ENOSPC, "No space left on device")

    class Log:
        lines: list = []

        def error(self, event, **kw):
            self.lines.append(event)

        info = warning = error

    monkeypatch.setattr(publisher, "publish_disk", full)  # where the trainer's publisher writes
    worker = TrainerWorker(cfg, trainer_cls(cfg.trainer, resolve_model("tiny-random-llama")), Null(), Null(), Null(),
                           rt=None)
    worker.log = Log()
    worker.trainer.version = 1
    worker.keep_for_eval()  # returns: the run goes on
    assert Log.lines == ["trainer.kept_for_eval_failed"]


def test_a_checkpoint_cut_by_a_full_disk_is_retried_in_place(tmp_path, trainer_cls, monkeypatch):  # noqa: F811
    """Issue 52 item 6: the write of a checkpoint that meets a full disk is tried again (the partial copy removed,
    so it holds no space) instead of ending the trainer; any other error still ends it."""
    import errno

    from areal_mq.engines.models import resolve_model
    from areal_mq.workers import trainer as trainer_mod

    cfg = RunConfig.model_validate({
        "run": {"run_dir": str(tmp_path / "run")}, "model": {"name": "tiny-random-llama"},
        "controller": {"batch_groups": 1, "total_steps": 1}, "trainer": {"publish_mode": "zmq"}})
    (tmp_path / "run").mkdir()
    import torch

    real, calls = torch.save, []

    def save_until_space(obj, path, *a, **kw):  # the first two writes of the JSON-side state meet a full disk
        calls.append(str(path))
        if len(calls) <= 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(obj, path, *a, **kw)

    class Log:
        lines: list = []

        def warning(self, event, **kw):
            self.lines.append(event)

        info = error = warning

    monkeypatch.setattr(trainer_mod, "CHECKPOINT_RETRY_BASE_S", 0.01)
    monkeypatch.setattr(torch, "save", save_until_space)
    worker = TrainerWorker(cfg, trainer_cls(cfg.trainer, resolve_model("tiny-random-llama")), Null(), Null(), Null(),
                           rt=None)
    worker.log = Log()
    worker.checkpoint()
    assert Log.lines.count("trainer.checkpoint_disk_full") == 2 and "trainer.checkpoint" in Log.lines
    root = tmp_path / "run" / "checkpoints"
    assert [p.name for p in root.iterdir() if p.is_dir()] == [f"step{worker.trainer.version:08d}"]  # no partial copy

    def broken(*a, **kw):
        raise OSError(errno.EIO, "I/O error")

    monkeypatch.setattr(torch, "save", broken)
    with pytest.raises(OSError, match="I/O error"):
        worker.checkpoint()
