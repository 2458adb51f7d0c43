"""GRPO advantages and reward transforms against hand-computed values."""
from __future__ import annotations

import math

import numpy as np
import pytest

from areal_mq.algorithms.advantages import group_advantages, transform_rewards
from areal_mq.algorithms.config import TrainerConfig
from areal_mq.algorithms.packing import samples_to_seqs
from areal_mq.messages import Sample, SeqSample

R = np.array([1.0, 0.0, 0.0, 1.0, 1.0])


def test_group_mean_and_std():
    adv = group_advantages(R, TrainerConfig(adv_eps=1e-12))
    mean, std = 0.6, math.sqrt(0.24)  # population std of (1,0,0,1,1)
    assert adv.tolist() == pytest.approx([(r - mean) / std for r in R])


def test_no_std_scaling():
    adv = group_advantages(R, TrainerConfig(adv_std_norm=False))
    assert adv.tolist() == pytest.approx([0.4, -0.6, -0.6, 0.4, 0.4])


def test_leave_one_out_baseline():
    adv = group_advantages(R, TrainerConfig(adv_baseline="leave_one_out", adv_std_norm=False))
    # sequence 0: others are (0,0,1,1) -> baseline 0.5; sequence 1: others (1,0,1,1) -> 0.75
    assert adv.tolist() == pytest.approx([0.5, -0.75, -0.75, 0.5, 0.5])


def test_identical_rewards_give_zero_advantage_not_nan():
    adv = group_advantages(np.ones(4), TrainerConfig())
    assert adv.tolist() == [0.0, 0.0, 0.0, 0.0]


def test_singleton_group_has_no_baseline():
    assert group_advantages(np.array([1.0]), TrainerConfig()).tolist() == [0.0]
    assert group_advantages(np.array([1.0]), TrainerConfig(adv_baseline="none")).tolist() == [1.0]


def test_reward_scale_bias_clip():
    cfg = TrainerConfig(reward_bias=-0.5, reward_scale=4.0, reward_clip=1.5)
    assert transform_rewards(np.array([0.0, 0.6, 1.0]), cfg).tolist() == pytest.approx([-1.5, 0.4, 1.5])


def test_every_generated_token_of_a_sequence_shares_its_advantage():
    seqs = [SeqSample(prompt_ids=[1, 2], output_ids=[3, 4, 5], logprobs=[-1, -1, -1], versions=[0, 0, 0],
                      reward=r) for r in (1.0, 0.0)]
    out = samples_to_seqs([Sample(sample_id="a", seqs=seqs)], TrainerConfig(adv_std_norm=False))
    assert [s.advantage for s in out] == [0.5, -0.5]
    from areal_mq.algorithms.packing import build_microbatch

    mb = build_microbatch(out, [0, 1], packed=True)
    assert mb.advantages.tolist() == [0.5] * 3 + [-0.5] * 3


def test_empty_completion_dropped_and_empty_prompt_refused():
    ok = SeqSample(prompt_ids=[1], output_ids=[2], logprobs=[-1], versions=[0], reward=1.0)
    empty = SeqSample(prompt_ids=[1], output_ids=[], logprobs=[], versions=[], reward=0.0)
    assert len(samples_to_seqs([Sample(sample_id="a", seqs=[ok, empty])], TrainerConfig())) == 1
    no_prompt = SeqSample(prompt_ids=[], output_ids=[2], logprobs=[-1], versions=[0], reward=1.0)
    with pytest.raises(ValueError, match="empty prompt"):
        samples_to_seqs([Sample(sample_id="b", seqs=[no_prompt])], TrainerConfig())
