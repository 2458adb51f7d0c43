"""The trainer worker drops a sample with a non-finite reward or behaviour logprob, naming it, instead of
training on it: one NaN would make the loss, and then every parameter, NaN.

The real TrainerWorker and Trainer (tiny Llama) with in-memory store, bus and publisher passed in.
Run: pytest tests/unit/algorithms/test_trainer_nonfinite.py -q
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from areal_mq.algorithms.config import TrainerConfig
from areal_mq.algorithms.trainer import Trainer
from areal_mq.config import load_config
from areal_mq.messages import SampleBatch
from areal_mq.workers.trainer import TrainerWorker, nonfinite_part
from tests.unit.algorithms.batches import make_samples


class _Log:
    def __init__(self):
        self.events: list[tuple[str, dict]] = []

    def __getattr__(self, level):
        return lambda event, **kw: self.events.append((event, kw))


class _Runtime:
    stopping = False

    def __init__(self):
        self.log = _Log()


class _Store:
    def __init__(self):
        self.acked: list[str] = []

    def ack(self, batch):
        self.acked.append(batch.batch_id)


class _Publisher:
    def publish(self, version, state_dict, config_json, **kw):
        return {"version": version}


class _Bus:
    def publish(self, topic, msg):
        pass


def _worker(tmp_path, model_dir):
    cfg = load_config(None, [f"run.run_dir={tmp_path}", "trainer.checkpoint_every=0"])
    trainer = Trainer(TrainerConfig(lr=1e-3, max_tokens_per_mb=64), model_dir)
    rt = _Runtime()
    return TrainerWorker(cfg, trainer, _Store(), _Bus(), _Publisher(), rt), rt.log


@pytest.mark.parametrize("where", ["logprob", "reward"])
def test_a_nonfinite_sample_is_dropped_and_named_not_trained(tmp_path, tiny_model_dir, where):
    worker, log = _worker(tmp_path, tiny_model_dir)
    samples = make_samples(1, n_groups=3, group_size=2)
    if where == "logprob":
        samples[1].seqs[1].logprobs[0] = np.nan
    else:
        samples[1].seqs[0].reward = math.inf
    metrics = worker.step(SampleBatch(batch_id="b1", samples=samples), 0.0)
    dropped = [kw for e, kw in log.events if e == "trainer.nonfinite_dropped"]
    assert len(dropped) == 1 and list(dropped[0]["samples"]) == [samples[1].sample_id]
    assert math.isfinite(metrics["loss"]) and worker.trainer.version == 1
    assert all(torch.isfinite(p).all() for p in worker.trainer.unwrapped.parameters())
    step = next(kw for e, kw in log.events if e == "trainer.step")
    assert samples[1].sample_id not in step["sample_ids"] and len(step["sample_ids"]) == 2
    assert worker.store.acked == ["b1"]  # the whole batch, the dropped sample included, is done with


def test_a_batch_of_only_nonfinite_samples_is_acked_without_a_step(tmp_path, tiny_model_dir):
    worker, log = _worker(tmp_path, tiny_model_dir)
    samples = make_samples(2, n_groups=1, group_size=2)
    samples[0].seqs[0].logprobs[:] = -np.inf
    assert worker.step(SampleBatch(batch_id="b2", samples=samples), 0.0) == {}
    assert worker.trainer.version == 0 and worker.store.acked == ["b2"]
    assert not [e for e, _ in log.events if e == "trainer.step"]


def test_nonfinite_part_names_what_is_wrong():
    sample = make_samples(3, n_groups=1, group_size=2)[0]
    assert nonfinite_part(sample) is None
    sample.seqs[1].logprobs[2] = np.nan
    assert nonfinite_part(sample) == "seq 1: logprobs at positions [2]"
