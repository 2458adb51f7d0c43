"""What the controller refuses to pass on: non-finite logprobs or rewards (the group fails, the store never
sees them), reward results whose every completion failed to score (a failed reward job), and a bus replay of
"base" taken as the policy version going back (a real older version from a resumed trainer is followed).

The real Controller runs against the test kit's InMemoryJobs and InMemoryStore (areal_mq.testing), passed in.
Run: pytest tests/unit/workers/test_controller_guards.py -q
"""
from __future__ import annotations

import math

import pytest

from areal_mq.config import load_config
from areal_mq.messages import GenerateRequest, GenerateResult, RewardResult, WeightsReady
from areal_mq.workers.controller import Controller, nonfinite_reason
from areal_mq.testing import InMemoryJobs, InMemoryStore, RecordingLog

from .test_admission import Formatter, _Data


def _controller(tmp_path, *sets):
    cfg = load_config(None, ["controller.batch_groups=1", "controller.group_size=2", "controller.max_retries=0",
                             "controller.max_concurrent_groups=1", f"run.run_dir={tmp_path}", *sets])
    jobs, store, log = InMemoryJobs(), InMemoryStore(), RecordingLog()
    return Controller(cfg, _Data(), Formatter(), jobs, store, log), jobs, store, log


def _answer_all(ctl, jobs, logprob=-0.1, rewards=None, errors=None):
    """Answer every pending job once (generation with `logprob`, reward with `rewards`/`errors`)."""
    for job_id in sorted(jobs.pending):
        msg = jobs.pending[job_id]
        if isinstance(msg, GenerateRequest):
            reply = GenerateResult(output_ids=[5, 6], logprobs=[-0.2, logprob], versions=[0, 0],
                                   finish_reason="stop", text="x")
        else:
            n = len(msg.completions)
            reply = RewardResult(rewards=rewards or [0.0, 1.0][:n], errors=errors or [])
        jobs.answer(job_id, reply)
    ctl.step(timeout=0.0)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_nonfinite_logprobs_fail_the_group_and_never_reach_the_store(tmp_path, bad):
    ctl, jobs, store, log = _controller(tmp_path)
    ctl.step(timeout=0.0)
    _answer_all(ctl, jobs, logprob=bad)
    assert store.samples == []
    failed = log.named("controller.group_failed")
    assert len(failed) == 1 and "non-finite logprobs at positions [1]" in failed[0]["reason"]
    assert ctl.ledger.balance()["failed"] == 1 and ctl.failed == 1
    ctl.step(timeout=0.0)
    assert jobs.pending, "the failed group's place in the bound was given to a new group"


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_nonfinite_rewards_fail_the_group_and_never_reach_the_store(tmp_path, bad):
    ctl, jobs, store, log = _controller(tmp_path)
    ctl.step(timeout=0.0)
    _answer_all(ctl, jobs)  # generations
    _answer_all(ctl, jobs, rewards=[1.0, bad])
    assert store.samples == []
    assert "non-finite rewards" in log.named("controller.group_failed")[0]["reason"]
    assert ctl.ledger.balance()["failed"] == 1


def test_finite_groups_are_stored(tmp_path):
    ctl, jobs, store, log = _controller(tmp_path)
    ctl.step(timeout=0.0)
    _answer_all(ctl, jobs)
    _answer_all(ctl, jobs)
    assert len(store.samples) == 1 and not log.named("controller.group_failed")


def test_a_reward_result_with_every_completion_unscored_is_a_failed_reward_job(tmp_path):
    """A reward task that raises gives default rewards plus errors; when no completion could be scored the
    group carries no signal, so it is retried and, past max_retries, fails (settled in the ledger)."""
    ctl, jobs, store, log = _controller(tmp_path, "controller.max_retries=1")
    ctl.step(timeout=0.0)
    _answer_all(ctl, jobs)
    _answer_all(ctl, jobs, rewards=[0.0, 0.0], errors=["exception: boom", "exception: boom"])
    assert log.named("controller.retry") and not store.samples
    ctl.retry_at = [(0.0, *r[1:]) for r in ctl.retry_at]  # due now
    ctl.step(timeout=0.0)
    _answer_all(ctl, jobs, rewards=[0.0, 0.0], errors=["exception: boom", "exception: boom"])
    assert "no completion could be scored" in log.named("controller.group_failed")[0]["reason"]
    assert ctl.ledger.balance()["failed"] == 1 and not store.samples


def test_a_reward_result_with_the_wrong_number_of_rewards_fails_the_group(tmp_path):
    """One reward per completion is the protocol; a reward worker out of it must not shorten or pad a group."""
    ctl, jobs, store, log = _controller(tmp_path, "controller.max_retries=2")
    ctl.step(timeout=0.0)
    _answer_all(ctl, jobs)
    _answer_all(ctl, jobs, rewards=[1.0])
    assert store.samples == [] and not log.named("controller.retry")
    assert "1 rewards for 2 completions" in log.named("controller.group_failed")[0]["reason"]
    assert ctl.ledger.balance()["failed"] == 1


def test_a_partly_scored_group_is_stored_with_its_defaults(tmp_path):
    ctl, jobs, store, log = _controller(tmp_path)
    ctl.step(timeout=0.0)
    _answer_all(ctl, jobs)
    _answer_all(ctl, jobs, rewards=[0.0, 1.0], errors=["exception: boom", None])
    assert len(store.samples) == 1


def test_nonfinite_reason():
    assert nonfinite_reason([0.0, -1.5], "x") is None and nonfinite_reason([], "x") is None
    assert "positions [0, 2]" in nonfinite_reason([math.nan, 1.0, math.inf], "x")


def test_a_base_replay_never_takes_the_version_back(tmp_path):
    """After a broker restart the bus may replay WeightsReady(0, "base"): admission must not shrink to v0."""
    ctl, jobs, store, log = _controller(tmp_path)
    ctl.on_ready(WeightsReady(version=0, mode="base"))
    assert ctl.version == 0
    ctl.on_ready(WeightsReady(version=5, mode="disk", path=str(tmp_path / "weights" / "v5")))
    ctl.on_ready(WeightsReady(version=0, mode="base"))
    assert ctl.version == 5 and log.named("controller.base_replay_ignored")
    # a real older version: the trainer resumed from a checkpoint, and the controller follows it
    ctl.on_ready(WeightsReady(version=3, mode="disk", path=str(tmp_path / "weights" / "v3")))
    assert ctl.version == 3


def test_a_full_store_is_back_pressure_the_group_is_stored_later_not_lost(tmp_path, monkeypatch):
    """Error(store_full) on a put: the controller keeps the group (its place in the bound, its results) and
    tries again; it used to let the JobFailed escape and the controller process died."""
    from areal_mq.errors import JobFailed
    from areal_mq.workers import controller as controller_mod

    monkeypatch.setattr(controller_mod, "STORE_FULL_RETRY_S", 0.0)
    ctl, jobs, store, log = _controller(tmp_path)
    full = {"left": 2}
    real_put = store.put

    def put(sample):
        if full["left"]:
            full["left"] -= 1
            raise JobFailed("sample store refused sample: [store_full] holding 10000 samples")
        real_put(sample)

    store.put = put
    ctl.step(timeout=0.0)
    _answer_all(ctl, jobs)  # generations
    _answer_all(ctl, jobs)  # rewards: the put is refused
    assert store.samples == [] and len(log.named("controller.store_full")) == 1
    assert ctl.ledger.balance()["stored"] == 0 and len(ctl.groups) == 1
    ctl.step(timeout=0.0)  # refused again
    ctl.step(timeout=0.0)  # stored
    assert len(store.samples) == 1
    assert ctl.ledger.balance()["stored"] == 1 and ctl.stored == 1 and store.samples[0].sample_id not in ctl.groups
