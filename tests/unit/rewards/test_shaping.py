"""DAPO's reward-side pieces (arXiv 2503.14476): the soft overlong punishment (eq. 13) worked by hand, dynamic
sampling by outcome versus by equal rewards, and both through the real Controller (test kit's in-memory jobs and
store): what reward jobs carry, what reaches the store, what is dropped and how it is reported."""
from __future__ import annotations

import pytest

from areal_mq.config import load_config
from areal_mq.errors import ConfigError
from areal_mq.messages import GenerateRequest, GenerateResult, RewardJob, RewardResult
from areal_mq.rewards.shaping import overlong_penalty, uniform_group
from areal_mq.testing import InMemoryJobs, InMemoryStore, RecordingLog
from areal_mq.workers.controller import Controller

from ..workers.test_admission import Formatter, _Data


def test_overlong_penalty_is_dapo_eq_13():
    # DAPO's setting: L_max 20,480, L_cache 4,096: no penalty to 16,384 tokens, then linear to -1 at 20,480
    assert overlong_penalty(16_384, 20_480, 4_096) == 0.0
    assert overlong_penalty(18_432, 20_480, 4_096) == pytest.approx(-0.5)  # (16384 - 18432) / 4096
    assert overlong_penalty(20_480, 20_480, 4_096) == pytest.approx(-1.0)
    assert overlong_penalty(20_481, 20_480, 4_096) == -1.0
    assert overlong_penalty(19_456, 20_480, 4_096, factor=0.5) == pytest.approx(-0.375)  # 0.5 x (-3072 / 4096)
    assert overlong_penalty(20_480, 20_480, 0) == 0.0  # off


def test_uniform_by_outcome_keeps_shaped_rewards_apart_and_falls_back_to_rewards_without_a_verdict():
    right, wrong = {"correct": True}, {"correct": False}
    # all wrong, rewards shaped apart by length: no outcome signal (DAPO drops it), though the rewards differ
    assert uniform_group([0.0, -0.4], [wrong, wrong], "outcome") == (True, "uniform_outcome")
    assert uniform_group([0.0, -0.4], [wrong, wrong], "reward") == (False, "uniform_reward")
    assert uniform_group([1.0, 0.0], [right, wrong], "outcome") == (False, "uniform_outcome")
    assert uniform_group([1.0, 1.0], [{}, {"correct": True}], "outcome") == (True, "uniform_reward")  # no verdict


def _controller(tmp_path, *sets):
    cfg = load_config(None, ["controller.batch_groups=1", "controller.group_size=2", "controller.max_retries=0",
                             "controller.max_concurrent_groups=1", "controller.max_new_tokens=8",
                             f"run.run_dir={tmp_path}", *sets])
    jobs, store, log = InMemoryJobs(), InMemoryStore(), RecordingLog()
    return Controller(cfg, _Data(), Formatter(), jobs, store, log), jobs, store, log


def _round(ctl, jobs, lengths, rewards, details):
    """Generate the group's answers (`lengths` tokens each), then score them; returns the reward job seen."""
    ctl.step(timeout=0.0)
    seen = []
    gens = [j for j in sorted(jobs.pending) if isinstance(jobs.pending[j], GenerateRequest)]
    for job_id, length in zip(gens, lengths):
        jobs.answer(job_id, GenerateResult(output_ids=[5] * length, logprobs=[-0.1] * length, versions=[0] * length,
                                           finish_reason="length" if length == 8 else "stop", text="x"))
    ctl.step(timeout=0.0)
    for job_id in sorted(jobs.pending):
        msg = jobs.pending[job_id]
        if isinstance(msg, RewardJob):
            seen.append(msg)
            jobs.answer(job_id, RewardResult(rewards=rewards, details=details))
    ctl.step(timeout=0.0)
    return seen


def test_reward_jobs_carry_lengths_and_the_cap_and_the_controller_adds_the_overlong_punishment(tmp_path):
    ctl, jobs, store, log = _controller(tmp_path, "controller.overlong_buffer=4", "controller.overlong_penalty=1.0")
    (job,) = _round(ctl, jobs, [3, 8], [1.0, 1.0], [{"correct": True}, {"correct": True}])
    assert job.lengths == [3, 8] and job.max_tokens == 8 and job.truncated == [False, True]
    (sample,) = store.samples
    rewards = sorted((len(s.output_ids), s.reward) for s in sample.seqs)
    assert rewards == [(3, 1.0), (8, pytest.approx(0.0))]  # 8 tokens of a cap of 8, buffer 4: -1
    cut = next(s for s in sample.seqs if len(s.output_ids) == 8)
    assert cut.info["reward_raw"] == 1.0 and cut.info["overlong_penalty"] == pytest.approx(-1.0)


def test_dynamic_sampling_by_outcome_drops_all_wrong_groups_and_reports_sampled_per_trained(tmp_path):
    ctl, jobs, store, log = _controller(tmp_path, "controller.drop_uniform_groups=true", "controller.uniform_by=outcome",
                                        "controller.overlong_buffer=4")
    wrong = [{"correct": False}, {"correct": False}]
    _round(ctl, jobs, [3, 8], [0.0, 0.0], wrong)  # rewards shaped apart (0 and -1) yet every answer wrong
    assert store.samples == [] and log.named("controller.group_dropped")[0]["reason"] == "uniform_outcome"
    _round(ctl, jobs, [3, 3], [1.0, 0.0], [{"correct": True}, {"correct": False}])
    assert len(store.samples) == 1 and ctl.stats()["sampled_per_trained"] == 2.0


def test_an_overlong_buffer_must_sit_inside_the_cap():
    with pytest.raises(ConfigError, match="overlong_buffer 8 must be below max_new_tokens"):
        load_config(None, ["controller.max_new_tokens=8", "controller.overlong_buffer=8"])
