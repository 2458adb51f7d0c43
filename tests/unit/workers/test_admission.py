"""The controller's staleness throttle never exceeds its bound, whatever order jobs complete in.

The real Controller runs against the test kit's InMemoryJobs and InMemoryStore (areal_mq.testing; passed in, not
patched); hypothesis drives random completion orders and trainer progress.
"""
from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from areal_mq.config import load_config
from areal_mq.data.loaders import Problem
from areal_mq.messages import GenerateRequest, GenerateResult, RewardJob, RewardResult
from areal_mq.workers.controller import Controller
from areal_mq.testing import InMemoryJobs, InMemoryStore, RecordingLog
from areal_mq.workers.controller_admission import can_admit


class Formatter:
    def ids(self, problem):
        return [1, 2, 3]


def _dataset():
    return iter([Problem(id=f"p{i}", prompt=f"{i}+1?", answer=str(i + 1), level=1) for i in range(10_000)])


class _Data:
    def __init__(self):
        self.it = _dataset()

    def __next__(self):
        return next(self.it)

    def state_dict(self):
        return {}


def _answer(jobs: InMemoryJobs, job_id: str, version: int, rewards=lambda n: [1.0] * n):
    msg = jobs.pending[job_id]
    if isinstance(msg, GenerateRequest):
        reply = GenerateResult(output_ids=[5], logprobs=[-0.1], versions=[version], finish_reason="stop", text="x")
    else:
        assert isinstance(msg, RewardJob)
        reply = RewardResult(rewards=rewards(len(msg.completions)))
    jobs.answer(job_id, reply)


@given(eta=st.integers(0, 3), batch=st.integers(1, 4), group=st.integers(1, 3), cap=st.integers(1, 12),
       seed=st.integers(0, 10_000), steps=st.integers(20, 200))
@settings(max_examples=60, deadline=None)
def test_admission_never_exceeds_the_bound(tmp_path_factory, eta, batch, group, cap, seed, steps):
    cfg = load_config(None, [f"controller.max_staleness={eta}", f"controller.batch_groups={batch}",
                             f"controller.group_size={group}", f"controller.max_concurrent_groups={cap}",
                             f"run.run_dir={tmp_path_factory.mktemp('run')}"])
    jobs, store = InMemoryJobs(), InMemoryStore()
    ctl = Controller(cfg, _Data(), Formatter(), jobs, store, RecordingLog())
    rng = random.Random(seed)
    trained = 0
    for _ in range(steps):
        ctl.step(timeout=0)
        assert ctl.submitted <= (eta + ctl.version + 1) * batch
        assert len(ctl.groups) <= cap
        if jobs.pending and rng.random() < 0.8:
            _answer(jobs, rng.choice(sorted(jobs.pending)), ctl.version)
        if len(store.samples) - trained >= batch and rng.random() < 0.3:  # the trainer consumes one batch
            trained += batch
            ctl.on_weights(ctl.version + 1)
    assert len({s.sample_id for s in store.samples}) == len(store.samples)  # each group stored once


def test_can_admit_examples():
    assert can_admit(0, 0, 0, 4, 0, 8) and not can_admit(4, 0, 0, 4, 0, 8)
    assert can_admit(11, 0, 2, 4, 0, 99) and not can_admit(12, 0, 2, 4, 0, 99)
    assert not can_admit(0, 0, 2, 4, 8, 8)


@given(seed=st.integers(0, 10_000), uniform_share=st.floats(0, 1))
@settings(max_examples=30, deadline=None)
def test_dropped_uniform_groups_are_replaced_without_breaking_the_bound(tmp_path_factory, seed, uniform_share):
    eta, batch = 1, 2
    cfg = load_config(None, [f"controller.max_staleness={eta}", f"controller.batch_groups={batch}",
                             "controller.group_size=2", "controller.max_concurrent_groups=4",
                             "controller.drop_uniform_groups=true", f"run.run_dir={tmp_path_factory.mktemp('run')}"])
    jobs, store = InMemoryJobs(), InMemoryStore()
    ctl = Controller(cfg, _Data(), Formatter(), jobs, store, RecordingLog())
    rng = random.Random(seed)
    rewards = lambda n: [1.0] * n if rng.random() < uniform_share else [0.0] + [1.0] * (n - 1)  # noqa: E731
    trained = 0
    for _ in range(300):
        ctl.step(timeout=0)
        assert ctl.submitted <= (eta + ctl.version + 1) * batch
        # a dropped group that still counted against the bound would leave nothing in flight and nothing to train
        assert jobs.pending, "dropped groups must be replaced, or training starves"
        _answer(jobs, rng.choice(sorted(jobs.pending)), ctl.version, rewards)
        if len(store.samples) - trained >= batch:
            trained += batch
            ctl.on_weights(ctl.version + 1)
    assert all(len({q.reward for q in s.seqs}) > 1 for s in store.samples), "a uniform group reached the store"
    assert len({s.sample_id for s in store.samples}) == len(store.samples)
    assert ctl.stored + ctl.dropped + len(ctl.groups) == ctl.next_group  # every group accounted for once
    if uniform_share < 0.5:  # (how far it gets with mostly-uniform rewards is luck: the no-stall check above is the rule)
        assert ctl.version >= 3, "dropped groups must be replaced, or training starves"
