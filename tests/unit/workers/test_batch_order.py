"""controller.batch_order: with `admission`, groups reach the store in the order they were admitted, whatever
order their answers come back in; none is lost, none waits forever behind a dropped or failed group, and a
full store holds the later groups back instead of letting them overtake.

The real Controller runs against the test kit's InMemoryJobs (areal_mq.testing); hypothesis drives random
completion orders, uniform-reward drops and failed jobs.
Run: pytest tests/unit/workers/test_batch_order.py -q
"""
from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from areal_mq.config import load_config
from areal_mq.errors import JobFailed
from areal_mq.messages import Error, GenerateRequest, GenerateResult, RewardResult
from areal_mq.testing import InMemoryJobs, RecordingLog
from areal_mq.workers.controller import Controller

from .test_admission import Formatter, _Data


class Store:
    """Keeps what was put, in order; `full` makes every put fail the way a full sample store answers."""

    def __init__(self):
        self.ids, self.full = [], False

    def put(self, sample):
        if self.full:
            raise JobFailed("[store_full] the store holds its maximum of samples")
        self.ids.append(sample.sample_id)

    def stats(self, timeout=5.0):
        return {"dropped_recent": []}


def _controller(tmp_path_factory, order: str, eta: int = 2, batch: int = 2):
    cfg = load_config(None, [f"controller.batch_order={order}", f"controller.max_staleness={eta}",
                             f"controller.batch_groups={batch}", "controller.group_size=2",
                             "controller.max_concurrent_groups=6", "controller.max_retries=0",
                             "controller.drop_uniform_groups=true", f"run.run_dir={tmp_path_factory.mktemp('run')}"])
    jobs, store = InMemoryJobs(), Store()
    return Controller(cfg, _Data(), Formatter(), jobs, store, RecordingLog()), jobs, store


def _play(ctl, jobs, store, rng, p_uniform=0.3, p_fail=0.1, versions=10):
    """Answer jobs in random order (failing some, scoring some groups uniform); the 'trainer' takes a batch
    whenever enough were stored, until `versions`; fails on a stall (nothing in flight and no batch)."""
    trained, idle = 0, 0
    for _ in range(20_000):
        if ctl.version >= versions:
            break
        ctl.step(timeout=0.0)
        if len(store.ids) - trained >= ctl.ctl_cfg.batch_groups:
            trained += ctl.ctl_cfg.batch_groups
            ctl.on_weights(ctl.version + 1)
            continue
        if not jobs.pending:
            idle += 1
            assert idle < 3, f"stuck at v{ctl.version}: held {sorted(ctl.held)}, order {list(ctl.admission_order)[:5]}"
            continue
        idle = 0
        job_id = rng.choice(sorted(jobs.pending))
        msg = jobs.pending[job_id]
        if rng.random() < p_fail:
            jobs.answer(job_id, Error(code="job_failed", message="boom", ref_id=job_id))
        elif isinstance(msg, GenerateRequest):
            jobs.answer(job_id, GenerateResult(output_ids=[5], logprobs=[-0.1], versions=[ctl.version],
                                               finish_reason="stop", text="x"))
        else:
            uniform = rng.random() < p_uniform
            jobs.answer(job_id, RewardResult(rewards=[1.0, 1.0] if uniform else [0.0, 1.0]))
    assert ctl.version >= versions, "training did not progress"


def _index(group_id: str) -> int:
    return int(group_id[1:8])


@given(seed=st.integers(0, 10_000), eta=st.integers(0, 3), batch=st.integers(1, 3),
       p_uniform=st.floats(0, 0.6), p_fail=st.floats(0, 0.3))
@settings(max_examples=60, deadline=None)
def test_admission_order_whatever_the_completion_order(tmp_path_factory, seed, eta, batch, p_uniform, p_fail):
    ctl, jobs, store = _controller(tmp_path_factory, "admission", eta, batch)
    _play(ctl, jobs, store, random.Random(seed), p_uniform, p_fail)
    assert store.ids == sorted(store.ids, key=_index), "a later-admitted group overtook an earlier one"
    b = ctl.ledger.balance()
    assert b["stored"] == len(store.ids) and b["admitted"] == b["stored"] + b["dropped_uniform"] + b["failed"] + \
        b["in_flight"]
    # nothing finished is left behind an earlier group that already left
    assert not ctl.held or _index(ctl.admission_order[0]) <= min(map(_index, ctl.held))
    assert set(ctl.held) <= set(ctl.groups)  # a held group is still in flight for the ledger (and for resume)


def test_completion_order_is_the_default_and_lets_fast_groups_overtake(tmp_path_factory):
    """The control: the same play with the default stores out of admission order (so the test above can fail)."""
    ctl, jobs, store = _controller(tmp_path_factory, "completion")
    assert load_config(None, []).controller.batch_order == "completion"
    _play(ctl, jobs, store, random.Random(1), p_fail=0.0)
    assert store.ids != sorted(store.ids, key=_index)


def test_a_full_store_holds_later_groups_back(tmp_path_factory):
    ctl, jobs, store = _controller(tmp_path_factory, "admission", eta=2, batch=2)
    ctl.step(timeout=0.0)
    head = ctl.admission_order[0]

    def answer(of_head: bool) -> None:
        for job_id, (kind, group, _) in sorted(ctl.by_job.items()):
            if (group == head) == of_head and job_id in jobs.pending:
                jobs.answer(job_id, GenerateResult(output_ids=[5], logprobs=[-0.1], versions=[0],
                                                   finish_reason="stop", text="x") if kind == "generate"
                            else RewardResult(rewards=[0.0, 1.0]))
        for _ in range(3):
            ctl.step(timeout=0.0)

    answer(of_head=False)
    answer(of_head=False)  # the others are generated and scored
    assert store.ids == [] and len(ctl.held) >= 2 and head not in ctl.held  # all wait for the first
    store.full = True
    answer(of_head=True)
    answer(of_head=True)
    assert store.ids == [] and ctl.groups[head].unstored is not None  # the head was refused: retried later
    store.full = False
    ctl.retry_at = [(0.0, *r[1:]) for r in ctl.retry_at]
    ctl.step(timeout=0.0)
    assert store.ids[0] == head and store.ids == sorted(store.ids, key=_index)
    assert not ctl.held
