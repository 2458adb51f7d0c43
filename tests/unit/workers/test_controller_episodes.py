"""The controller's episode path (agent.workflow set) and the one store path it shares with single answers.

EpisodePath submits each sample of a group as an EpisodeJob; a complete group of EpisodeResults goes through
the same `_store` as a rewarded group of GenerateResults: the same reward stats, policy versions (an episode's
environment tokens, version -1, are not a policy version), uniform-group drop, ledger outcome and put. The
real Controller runs against the test kit's InMemoryJobs and InMemoryStore (areal_mq.testing; passed in, not patched).
Run: pytest tests/unit/workers/test_controller_episodes.py -q
"""
from __future__ import annotations

import pytest

from areal_mq.config import load_config
from areal_mq.messages import (EpisodeJob, EpisodeResult, Error, GenerateRequest, GenerateResult, RewardJob,
                               RewardResult, SeqSample)
from areal_mq.workers.controller import Controller, request_seed
from areal_mq.workers.controller_episodes import EpisodePath
from areal_mq.testing import InMemoryJobs, InMemoryStore, RecordingLog

from .test_admission import Formatter, _Data


def _controller(tmp_path, *sets, workflow="multi_turn_retry"):
    cfg = load_config(None, ["controller.batch_groups=1", "controller.group_size=2", "controller.max_retries=1",
                             "controller.max_concurrent_groups=1", f"run.run_dir={tmp_path}",
                             f"agent.workflow={workflow}", *sets])
    jobs, store, log = InMemoryJobs(), InMemoryStore(), RecordingLog()
    return Controller(cfg, _Data(), Formatter(), jobs, store, log), jobs, store, log


def _episode(reward: float, version: int = 0) -> EpisodeResult:
    """Model turn (2 tokens), feedback (1 environment token, version -1), model turn (1 token)."""
    return EpisodeResult(seq=SeqSample(prompt_ids=[1, 2, 3], output_ids=[5, 6, 9, 7], logprobs=[-0.1, -0.2, 0.0, -0.3],
                                       versions=[version, version, -1, version + 1], loss_mask=[1, 1, 0, 1],
                                       reward=reward), turns=2)


def _answer(ctl, jobs, episode_rewards=(0.0, 1.0), answer_rewards=(0.0, 1.0)):
    """Answer every pending job once: episodes with `episode_rewards` (by sample index), generations, rewards."""
    for job_id in sorted(jobs.pending):
        msg = jobs.pending[job_id]
        if isinstance(msg, EpisodeJob):
            reply = _episode(episode_rewards[msg.sample_index])
        elif isinstance(msg, GenerateRequest):
            reply = GenerateResult(output_ids=[5, 6, 7, 8], logprobs=[-0.1] * 4, versions=[0, 0, 1, 1],
                                   finish_reason="stop", text="x")
        else:
            assert isinstance(msg, RewardJob)
            reply = RewardResult(rewards=list(answer_rewards))
        jobs.answer(job_id, reply)
    ctl.step(timeout=0.0)


def test_each_sample_is_an_episode_job_for_the_agents(tmp_path):
    ctl, jobs, store, log = _controller(tmp_path)
    ctl.on_weights(3)
    ctl.step(timeout=0.0)
    assert sorted(jobs.services.values()) == ["agent", "agent"]
    sent = sorted(jobs.pending.values(), key=lambda m: m.sample_index)
    assert all(isinstance(m, EpisodeJob) for m in sent)
    group_id = next(iter(ctl.groups))
    assert [m.episode_id for m in sent] == [f"{group_id}-e0", f"{group_id}-e1"]
    assert all(m.group_id == group_id and m.problem_id == "p0" and m.answer == "1" and m.min_version == 3
               for m in sent)
    assert [m.sampling.seed for m in sent] == [request_seed(ctl.cfg.run.seed, group_id, i) for i in range(2)]
    assert [list(m.prompt_ids) for m in sent] == [[1, 2, 3]] * 2


def test_a_complete_group_of_episodes_is_stored_once_with_its_turns(tmp_path):
    ctl, jobs, store, log = _controller(tmp_path)
    ctl.step(timeout=0.0)
    _answer(ctl, jobs)
    assert len(store.samples) == 1 and ctl.ledger.balance()["stored"] == 1 and not ctl.groups
    sample = store.samples[0]
    assert sample.meta == {"level": 1, "episodes": True, "turns": [2, 2]}
    assert [s.reward for s in sample.seqs] == [0.0, 1.0] and ctl.rewards == [0.0, 1.0]
    assert ctl.gen_tokens == 6, "only the model's tokens (mask 1) count as generated"
    stored = log.named("controller.group_stored")
    assert stored[0]["versions"] == [0, 1] and stored[0]["reward_mean"] == 0.5  # -1 is no policy version


@pytest.mark.parametrize("workflow", ["multi_turn_retry", ""])
def test_both_kinds_of_group_share_the_uniform_drop(tmp_path, workflow):
    """One store path: a uniform group of episodes is dropped exactly as a uniform group of single answers."""
    ctl, jobs, store, log = _controller(tmp_path, "controller.drop_uniform_groups=true", workflow=workflow)
    ctl.step(timeout=0.0)
    _answer(ctl, jobs, episode_rewards=(1.0, 1.0), answer_rewards=(1.0, 1.0))
    if not workflow:
        _answer(ctl, jobs, answer_rewards=(1.0, 1.0))  # the reward job
    assert store.samples == [] and ctl.dropped == 1 and ctl.ledger.balance()["dropped_uniform"] == 1
    dropped = log.named("controller.group_dropped")
    assert len(dropped) == 1 and dropped[0]["versions"] == [0, 1] and dropped[0]["reward_mean"] == 1.0
    assert ctl.dropped_by_length and ctl.rewards == [1.0, 1.0]
    ctl.step(timeout=0.0)
    assert jobs.pending, "the dropped group's place in the bound was given to a new group"


def test_a_failed_episode_is_retried_as_an_episode_then_fails_the_group(tmp_path):
    ctl, jobs, store, log = _controller(tmp_path)
    ctl.step(timeout=0.0)
    first = sorted(jobs.pending)[0]
    index = jobs.pending[first].sample_index
    jobs.answer(first, Error(code="job_failed", message="workflow raised", ref_id=first))
    ctl.step(timeout=0.0)
    assert log.named("controller.retry")[0]["stage"] == "episode"
    ctl.retry_at = [(0.0, *r[1:]) for r in ctl.retry_at]  # due now
    ctl.step(timeout=0.0)
    again = [j for j, m in jobs.pending.items() if m.sample_index == index]
    assert len(again) == 1 and isinstance(jobs.pending[again[0]], EpisodeJob) and jobs.services[again[0]] == "agent"
    retried = again[0]
    jobs.answer(retried, Error(code="job_failed", message="workflow raised", ref_id=retried))
    ctl.step(timeout=0.0)
    assert ctl.ledger.balance()["failed"] == 1 and not store.samples
    assert log.named("controller.group_failed")[0]["stage"] == "episode"


def test_episode_path_reads_a_group_in_sample_order():
    results = [_episode(0.25), _episode(0.75, version=4)]
    seqs, meta = EpisodePath.scored(results)
    assert [s.reward for s in seqs] == [0.25, 0.75] and meta == {"episodes": True, "turns": [2, 2]}
    assert EpisodePath.generated_tokens(results[0]) == 3
