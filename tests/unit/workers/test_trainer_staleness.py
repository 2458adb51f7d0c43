"""η as an exported invariant (issue 27 item 5): the trainer's metrics, in metrics.jsonl and every sink.

The real TrainerWorker and Trainer (tiny model) against a real in-process sample store, at version 5 with η = 2:
one sample of each kind (single answers, a multi-turn episode, an episode recorded through the OpenAI endpoint)
exactly at the bound (oldest generated token at v - η: trained, staleness_max = η, no violation) and one of
each a version older (dropped by the store, counted in the step's dropped_stale). A batch handed to the worker
past the store (as an older store or another writer could) shows the violation counter is not a constant 0.
"""
from __future__ import annotations

import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import zmq

from areal_mq.client import StoreClient
from areal_mq.config import RunConfig
from areal_mq.messages import SampleBatch
from areal_mq.telemetry.metrics import JsonlSink, MetricsSinks, jsonl_path
from areal_mq.testing import RecordingLog
from areal_mq.workers.trainer import TrainerWorker, staleness_violations
from tests.unit.brokers.test_sample_store import ETA, V, Running, _multi_turn, _openai, _single

KEYS = ("staleness_max", "staleness_bound", "staleness_violations", "dropped_stale", "dropped_stale_total")


class Null:
    def publish(self, *args, **kw):
        return None


class RecordingSink:
    """A metrics sink that keeps what it was given (stands for TensorBoard / W&B, which take the same dict)."""

    name = "recording"

    def __init__(self):
        self.steps: list[tuple[int, dict]] = []

    def write(self, step, metrics):
        self.steps.append((step, dict(metrics)))

    def close(self):
        pass


@pytest.fixture
def worker(tmp_path):
    import torch
    from accelerate.state import AcceleratorState

    from areal_mq.algorithms.trainer import Trainer
    from areal_mq.engines.models import resolve_model

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    cfg = RunConfig.model_validate({
        "run": {"run_dir": str(tmp_path / "run"), "mode": "async"}, "model": {"name": "tiny-random-llama"},
        "controller": {"batch_groups": 3, "max_staleness": ETA},
        "trainer": {"checkpoint_every": 0, "max_tokens_per_mb": 128}})
    (tmp_path / "run").mkdir()
    trainer = Trainer(cfg.trainer, resolve_model("tiny-random-llama"))
    trainer.version = V
    sink = RecordingSink()
    sinks = MetricsSinks([JsonlSink(jsonl_path(cfg.run.run_dir, "trainer")), sink], "trainer")
    ctx = zmq.Context()
    run = Running(ctx, "inproc://staleness", tmp_path / "store")
    client = StoreClient("inproc://staleness", ctx=ctx)
    w = TrainerWorker(cfg, trainer, client, Null(), Null(), rt=None, sinks=sinks)
    w.log, w.first_get, w.recording = RecordingLog(), False, sink
    try:
        yield w, client, run
    finally:
        client.close()
        run.stop()
        ctx.term()
        torch.set_num_threads(before)
        AcceleratorState._reset_state(reset_partial_state=True)


def _lines(w) -> list[dict]:
    return [json.loads(x) for x in jsonl_path(w.cfg.run.run_dir, "trainer").read_text().splitlines()]


def test_every_kind_at_the_bound_is_trained_without_violation_and_older_ones_are_counted(worker):
    w, client, run = worker
    for make in (_single, _multi_turn, _openai):
        client.put(make(f"past-{make.__name__}", V - ETA - 1))
        client.put(make(f"at-{make.__name__}", V - ETA))
    batch = w.next_batch()
    assert sorted(s.sample_id for s in batch.samples) == ["at-_multi_turn", "at-_openai", "at-_single"]
    w.step(batch, 0.0)
    line = _lines(w)[-1]
    assert {k: line[k] for k in KEYS} == {"staleness_max": ETA, "staleness_bound": ETA, "staleness_violations": 0,
                                          "dropped_stale": 3, "dropped_stale_total": 3}
    assert line["staleness_hist"][ETA] > 0 and len(line["staleness_hist"]) == ETA + 1
    step, recorded = w.recording.steps[-1]  # every sink got the same keys
    assert step == V + 1 and {k: recorded[k] for k in KEYS} == {k: line[k] for k in KEYS}
    assert run.store.counters["dropped_stale"] == 3 and not w.log.named("trainer.staleness_violation")

    client.put(_single("later", V - ETA + 1))  # the next step: nothing dropped since, the total stays
    w.cfg.controller.batch_groups = 1
    w.step(w.next_batch(), 0.0)
    assert {k: _lines(w)[-1][k] for k in ("dropped_stale", "dropped_stale_total", "staleness_violations")} == \
        {"dropped_stale": 0, "dropped_stale_total": 3, "staleness_violations": 0}


def test_a_token_past_the_bound_is_counted_and_logged(worker):
    w, _, _ = worker
    past = [_single("s", V - ETA - 1), _multi_turn("m", V - ETA)]
    w.step(SampleBatch(batch_id="b", samples=past), 0.0)  # handed in past the store, which would drop "s"
    line = _lines(w)[-1]
    assert line["staleness_max"] == ETA + 1 and line["staleness_violations"] == line["staleness_hist"][ETA + 1] == 1
    assert w.log.named("trainer.staleness_violation")[0]["tokens"] == 1


def test_violations_count_the_tokens_past_eta():
    assert staleness_violations([4, 0, 2, 1, 3], 2) == 4
    assert staleness_violations([4, 0, 2], 2) == 0 and staleness_violations([], 0) == 0
    assert staleness_violations([1, 1], 0) == 1  # sync: any stale token is a violation
