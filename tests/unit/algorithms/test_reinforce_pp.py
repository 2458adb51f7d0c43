"""REINFORCE++'s global-batch advantage normalisation (trainer.adv_estimator reinforce_pp) against hand numbers."""
from __future__ import annotations

import math

import numpy as np
import pytest

from areal_mq.algorithms.advantages import ADVANTAGE_ESTIMATORS, step_advantages
from areal_mq.algorithms.config import TrainerConfig
from areal_mq.algorithms.packing import plan_step, samples_to_seqs
from tests.unit.algorithms.batches import make_samples


def test_reinforce_pp_normalises_over_the_whole_step_by_hand():
    """REINFORCE++ (Hu et al. 2025, arXiv 2501.03262, eq. 10): A_norm = (A - mean_batch(A)) / std_batch(A), the
    mean and std over every sequence of the global batch, not per prompt. Rewards 1, 0 | 1, 1 | 0, 0:
    mean 0.5, population std 0.5, so every right answer gets +1 and every wrong one -1, even inside the all-right
    and all-wrong groups (which GRPO would give 0)."""
    groups = [np.array([1.0, 0.0]), np.array([1.0, 1.0]), np.array([0.0, 0.0])]
    got = step_advantages(groups, TrainerConfig(adv_estimator="reinforce_pp", adv_eps=1e-12))
    assert [g.tolist() for g in got] == [pytest.approx([1.0, -1.0]), pytest.approx([1.0, 1.0]),
                                         pytest.approx([-1.0, -1.0])]


def test_reinforce_pp_uneven_groups_and_transformed_rewards_by_hand():
    """Rewards 3 | 0, 1 with reward_bias -1 and reward_scale 2: transformed 4 | -2, 0; mean 2/3,
    std sqrt(((10/3)^2 + (8/3)^2 + (2/3)^2) / 3) = sqrt(56/9); adv_std_norm false subtracts the mean only."""
    groups = [np.array([3.0]), np.array([0.0, 1.0])]
    cfg = dict(adv_estimator="reinforce_pp", reward_bias=-1.0, reward_scale=2.0)
    std = math.sqrt(56 / 9)
    got = step_advantages(groups, TrainerConfig(adv_eps=1e-12, **cfg))
    assert got[0].tolist() == pytest.approx([(10 / 3) / std])
    assert got[1].tolist() == pytest.approx([(-8 / 3) / std, (-2 / 3) / std])
    got = step_advantages(groups, TrainerConfig(adv_std_norm=False, **cfg))
    assert [g.tolist() for g in got] == [pytest.approx([10 / 3]), pytest.approx([-8 / 3, -2 / 3])]


def test_reinforce_pp_all_equal_rewards_give_zero_not_nan_and_is_registered():
    assert "reinforce_pp" in ADVANTAGE_ESTIMATORS
    got = step_advantages([np.ones(3), np.ones(1)], TrainerConfig(adv_estimator="reinforce_pp"))
    assert [g.tolist() for g in got] == [[0.0, 0.0, 0.0], [0.0]]
    assert step_advantages([], TrainerConfig(adv_estimator="reinforce_pp")) == []


def test_every_data_parallel_rank_trains_with_the_same_global_normalisation():
    """The estimator runs on the whole step's sequences before plan_step splits them between ranks: two ranks
    computing their shares from the same sample list see one batch mean and std (the trainer's layout)."""
    samples = make_samples(seed=3, n_groups=4, group_size=3)
    cfg = TrainerConfig(adv_estimator="reinforce_pp")
    seqs = samples_to_seqs(samples, cfg)
    advs = np.array([s.advantage for s in seqs])
    assert advs.mean() == pytest.approx(0.0, abs=1e-9)  # the whole step's mean is removed, not each rank's
    shares = [sorted(i for mb in plan_step(seqs, cfg, 2, r).minibatches for b in mb for i in b) for r in range(2)]
    assert sorted(shares[0] + shares[1]) == list(range(len(seqs)))
    for r in range(2):  # each rank's share keeps the global advantages (its own mean is generally not 0)
        again = samples_to_seqs(samples, cfg)
        assert [again[i].advantage for i in shares[r]] == [seqs[i].advantage for i in shares[r]]


def test_reinforce_pp_baseline_centres_each_group_then_normalises_over_the_step_by_hand():
    """REINFORCE++-baseline (arXiv 2501.03262, the group-baseline variant; OpenRLHF's reinforce_baseline): A = r -
    mean_group(r), then (A - mean_batch(A)) / std_batch(A). Rewards 1, 0 | 1, 1 | 0, 0, 1: centred 1/2, -1/2 | 0, 0 |
    -1/3, -1/3, 2/3; their batch mean is 0 and their population variance (1/4 + 1/4 + 1/9 + 1/9 + 4/9) / 7 = 1/6, so
    every centred value is multiplied by sqrt(6). GRPO would divide each group by its own std instead (1, -1 and
    -0.71, -0.71, 1.41); REINFORCE++ without the baseline would give the all-right group +1 each."""
    groups = [np.array([1.0, 0.0]), np.array([1.0, 1.0]), np.array([0.0, 0.0, 1.0])]
    got = step_advantages(groups, TrainerConfig(adv_estimator="reinforce_pp_baseline", adv_eps=1e-12))
    r6 = math.sqrt(6)
    assert [g.tolist() for g in got] == [pytest.approx([r6 / 2, -r6 / 2]), pytest.approx([0.0, 0.0]),
                                         pytest.approx([-r6 / 3, -r6 / 3, 2 * r6 / 3])]
    # a lone sequence has no group to be compared with: 0, and it still counts in the step's std
    got = step_advantages([np.array([3.0]), np.array([1.0, 0.0])],
                          TrainerConfig(adv_estimator="reinforce_pp_baseline", adv_eps=1e-12))
    std = math.sqrt((0.25 + 0.25) / 3)
    assert [g.tolist() for g in got] == [[0.0], pytest.approx([0.5 / std, -0.5 / std])]
    # with the KL folded in per token, the estimator hands the centred rewards on (normalize_returns normalises them)
    cfg = TrainerConfig(adv_estimator="reinforce_pp_baseline", kl_coef=0.1, kl_in="reward_normalized")
    assert [g.tolist() for g in step_advantages(groups, cfg)][0] == pytest.approx([0.5, -0.5])
    assert "reinforce_pp_baseline" in ADVANTAGE_ESTIMATORS
