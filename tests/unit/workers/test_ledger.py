"""The admission ledger: losses (failed groups, stale drops, uniform drops) never eat the staleness bound.

Before the ledger, a group that failed after max_retries, or that the store dropped as stale, kept its place
in the bound forever: once the losses exceeded η · batch_groups the controller admitted nothing more and the
trainer waited forever (sync mode, η = 0: after one failure). The real Controller runs against in-memory
stand-ins (areal_mq.testing's InMemoryJobs); hypothesis drives random failures, stale drops and uniform drops.
Run: pytest tests/unit/workers/test_ledger.py -q
"""
from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from areal_mq.config import load_config
from areal_mq.workers.controller_admission import AdmissionLedger
from areal_mq.messages import Error, GenerateRequest, GenerateResult, RewardResult
from areal_mq.workers.controller import Controller
from areal_mq.testing import InMemoryJobs, RecordingLog

from .test_admission import Formatter, _Data


class StoreWithDrops:
    """Keeps what was put; `drop(n)` plays the store dropping the n oldest untrained samples as stale."""

    def __init__(self):
        self.samples, self.pending, self.dropped = [], [], []

    def put(self, sample):
        self.samples.append(sample)
        self.pending.append(sample.sample_id)

    def take(self, n):
        batch, self.pending = self.pending[:n], self.pending[n:]
        return batch

    def drop(self, n):
        gone, self.pending = self.pending[:n], self.pending[n:]
        self.dropped += [[sid, "stale"] for sid in gone]

    def stats(self, timeout=5.0):
        return {"dropped_recent": self.dropped[-1000:]}


def test_ledger_settles_each_group_once():
    led = AdmissionLedger()
    for g in "abcd":
        led.admit(g)
    assert led.settle("a", "stored") and not led.settle("a", "stored") and not led.settle("a", "failed")
    assert led.settle("b", "failed") and led.settle("c", "dropped_uniform")
    assert led.settle("a", "stale") and not led.settle("a", "stale")
    assert not led.settle("d", "stale")  # in flight: not stored yet, so the store cannot have dropped it
    assert not led.settle("zzz", "failed")
    assert led.counted == 1 and led.balance()["in_flight"] == 1  # only d still counts
    with pytest.raises(ValueError):
        led.settle("d", "lost")
    saved = led.state()
    again = AdmissionLedger()
    again.restore(saved)
    assert again.counted == 0 and not again.settle("a", "stale")  # d is regenerated on resume; a settled once


@given(eta=st.integers(0, 3), batch=st.integers(1, 3), group=st.integers(2, 3), seed=st.integers(0, 10_000),
       p_fail=st.floats(0, 0.5), p_stale=st.floats(0, 0.5), p_uniform=st.floats(0, 0.5))
@settings(max_examples=60, deadline=None)
def test_losses_never_deadlock_nor_exceed_the_bound(tmp_path_factory, eta, batch, group, seed, p_fail, p_stale,
                                                    p_uniform):
    cfg = load_config(None, [f"controller.max_staleness={eta}", f"controller.batch_groups={batch}",
                             f"controller.group_size={group}", "controller.max_concurrent_groups=8",
                             "controller.max_retries=0", "controller.drop_uniform_groups=true",
                             f"run.run_dir={tmp_path_factory.mktemp('run')}"])
    jobs, store, rng = InMemoryJobs(), StoreWithDrops(), random.Random(seed)
    ctl = Controller(cfg, _Data(), Formatter(), jobs, store, RecordingLog())
    version, idle = 0, 0
    for _ in range(20_000):
        if version >= 12:
            break
        ctl._next_store_poll = 0.0  # poll the store's drops every round here
        ctl.step(timeout=0.0)
        assert ctl.submitted <= (eta + version + 1) * batch
        if len(store.pending) >= batch:
            if rng.random() < p_stale:
                store.drop(1)
                continue
            store.take(batch)
            version += 1
            ctl.on_weights(version)
            idle = 0
            continue
        if jobs.pending:
            idle = 0
        else:
            idle += 1
            assert idle < 3, f"deadlock at v{version}: nothing in flight, {len(store.pending)} stored, " \
                             f"ledger {ctl.ledger.balance()}"
            continue
        job_id = rng.choice(sorted(jobs.pending))
        msg = jobs.pending[job_id]
        if rng.random() < p_fail:
            jobs.answer(job_id, Error(code="job_failed", message="boom", ref_id=job_id))
        elif isinstance(msg, GenerateRequest):
            jobs.answer(job_id, GenerateResult(output_ids=[5], logprobs=[-0.1], versions=[version],
                                                        finish_reason="stop", text="x"))
        else:
            uniform = rng.random() < p_uniform
            rewards = [1.0] * len(msg.completions) if uniform else [float(i) for i in range(len(msg.completions))]
            jobs.answer(job_id, RewardResult(rewards=rewards))
    assert version >= 12, "training did not progress"
    b = ctl.ledger.balance()
    assert b["admitted"] == b["stored"] + b["dropped_uniform"] + b["failed"] + b["in_flight"]


def test_sync_mode_survives_a_failed_group(tmp_path):
    """η = 0: before the ledger, one failed group kept admission closed forever."""
    cfg = load_config(None, ["run.mode=sync", "controller.batch_groups=2", "controller.group_size=1",
                             "controller.max_retries=0", f"run.run_dir={tmp_path}"])
    jobs, store = InMemoryJobs(), StoreWithDrops()
    ctl = Controller(cfg, _Data(), Formatter(), jobs, store, RecordingLog())
    ctl.step(timeout=0.0)
    first = sorted(jobs.pending)[0]
    jobs.answer(first, Error(code="job_failed", message="reward task raised", ref_id=first))
    for _ in range(10):
        ctl.step(timeout=0.0)
        for job_id in sorted(jobs.pending):
            msg = jobs.pending[job_id]
            jobs.answer(job_id, GenerateResult(output_ids=[5], logprobs=[-0.1], versions=[0],
                                                        finish_reason="stop", text="x")
                                 if isinstance(msg, GenerateRequest) else RewardResult(rewards=[1.0]))
    assert len(store.pending) == 2, "a replacement for the failed group was admitted and stored"
