"""A resumed trainer with a long history: nothing trained twice, nothing lost, no request over the limits.

The real TrainerWorker and Trainer (tiny model) against a real in-process sample store; the first trainer
"crashes" between writing its checkpoint and acking the batch inside it (its store stand-in fails the ack).
Its history holds 200,000 ids: sent in one GetBatch header (the old resume) they exceed the 4 MiB limit.
"""
from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import zmq

from areal_mq.client import StoreClient
from areal_mq.config import RunConfig
from areal_mq.workers.trainer import TrainerWorker
from tests.unit.algorithms.batches import make_samples
from tests.unit.brokers.test_sample_store import Running


class Null:
    def publish(self, *args, **kw):
        return None


class AckCrashes:
    """The store as a trainer sees it, until the process dies right after its checkpoint is written."""

    def __init__(self, store):
        self.store = store

    def get_batch(self, *args, **kw):
        return self.store.get_batch(*args, **kw)

    def ack(self, *args, **kw):
        raise SystemExit("killed between checkpoint and ack")


@pytest.fixture
def trainer_cls():
    import torch
    from accelerate.state import AcceleratorState

    from areal_mq.algorithms.trainer import Trainer

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield Trainer
    torch.set_num_threads(before)
    AcceleratorState._reset_state(reset_partial_state=True)


def test_resume_after_a_crash_between_checkpoint_and_ack_with_a_long_history(tmp_path, trainer_cls):
    from areal_mq.engines.models import resolve_model

    model = resolve_model("tiny-random-llama")
    cfg = RunConfig.model_validate({
        "run": {"run_dir": str(tmp_path / "run")}, "model": {"name": "tiny-random-llama"},
        "controller": {"batch_groups": 2, "max_staleness": 1},
        "trainer": {"checkpoint_every": 1, "max_tokens_per_mb": 128}})
    (tmp_path / "run").mkdir()
    ctx = zmq.Context()
    run = Running(ctx, "inproc://resume", tmp_path / "store")
    controller, store = StoreClient("inproc://resume", ctx=ctx), StoreClient("inproc://resume", ctx=ctx)
    try:
        samples = make_samples(3, n_groups=4, group_size=2, version=0, staleness=0)
        for s in samples:
            controller.put(s)
        first = trainer_cls(cfg.trainer, model)
        first.consumed_ids = [f"p{i:08d}-g{i:06d}-e0" for i in range(200_000)]  # a long run's history
        crashing = TrainerWorker(cfg, first, AckCrashes(store), Null(), Null(), rt=None)
        crashing.first_get = False
        batch = crashing.next_batch()
        trained = sorted(s.sample_id for s in batch.samples)
        with pytest.raises(SystemExit):
            crashing.step(batch, 0.0)  # trains, checkpoints v1, dies before the ack
        assert run.store.counters["acked"] == 0 and run.store.stats()["leased"] == 2

        resumed = TrainerWorker(cfg, trainer_cls(cfg.trainer, model), store, Null(), Null(), rt=None)
        resumed.resume()
        assert resumed.trainer.version == 1
        got = resumed.next_batch()  # the old resume sent all 200,002 ids here: refused as too_large
        assert sorted(s.sample_id for s in got.samples) == sorted(
            s.sample_id for s in samples if s.sample_id not in trained)  # nothing trained twice, nothing lost
        assert run.store.counters["acked"] == 2 and set(trained) <= set(run.store.done)
    finally:
        controller.close()
        store.close()
        run.stop()
        ctx.term()
