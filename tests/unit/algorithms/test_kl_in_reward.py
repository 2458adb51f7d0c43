"""trainer.kl_in reward: the KL to the reference folded into the advantage (REINFORCE++), against hand numbers."""
from __future__ import annotations

import pytest
import torch

from areal_mq.algorithms.config import TrainerConfig
from areal_mq.algorithms.ppo import kl_in_reward, ppo_loss, suffix_sums


def test_suffix_sums_stay_inside_each_sequence():
    x = torch.tensor([1.0, 2.0, 3.0, 10.0, 20.0, 5.0])
    seq_index = torch.tensor([0, 0, 0, 1, 1, 2])
    assert suffix_sums(x, seq_index).tolist() == [6.0, 5.0, 3.0, 30.0, 20.0, 5.0]


def test_kl_folded_into_the_advantage_by_hand():
    """REINFORCE++ (Hu et al. 2025, arXiv 2501.03262, eq. 8-9): A_t = r - beta * sum_{i=t}^T KL(i), KL(i) = log
    pi_old(o_i) - log pi_ref(o_i) (k1). Sequence 0: A = 1, KL = (0.5, -0.25, 1.0), beta 0.1 -> suffix sums
    (1.25, 0.75, 1.0) -> A_t = (0.875, 0.925, 0.9). Sequence 1: A = -1, KL = (2.0,) -> -1.2."""
    behav = torch.tensor([-1.0, -2.0, -0.5, -3.0], dtype=torch.float64)
    ref = torch.tensor([-1.5, -1.75, -1.5, -5.0], dtype=torch.float64)
    adv = torch.tensor([1.0, 1.0, 1.0, -1.0], dtype=torch.float64)
    got, kl_sum = kl_in_reward(adv, behav, ref, torch.tensor([0, 0, 0, 1]), 0.1)
    assert got.tolist() == pytest.approx([0.875, 0.925, 0.9, -1.2])
    assert float(kl_sum) == pytest.approx(3.25)


def test_reward_mode_has_no_kl_term_in_the_loss_by_hand():
    """One token, behav_correction off (prox = behaviour = logp, so r = 1, no clipping): the loss is -A_t, with
    A_t = A - kl_coef * (b - ref) = 2 - 0.5 * (-1 - (-3)) = 1; the loss mode instead adds kl_coef * k3(logp, ref)."""
    logp = torch.tensor([-1.0], requires_grad=True)
    behav, ref, adv, seq_index = torch.tensor([-1.0]), torch.tensor([-3.0]), torch.tensor([2.0]), torch.tensor([0])
    cfg = TrainerConfig(behav_correction=False, kl_coef=0.5, kl_in="reward")
    loss, st = ppo_loss(logp, behav, behav, adv, 1.0, cfg, ref, seq_index)
    assert float(loss.detach()) == pytest.approx(-1.0) and float(st.kl_sum) == pytest.approx(2.0)
    loss.backward()
    assert logp.grad.tolist() == pytest.approx([-1.0])  # d(-r * A_t)/dlogp = -A_t: the KL carries no gradient
    d = -3.0 - -1.0  # k3 = e^d - d - 1
    loss, _ = ppo_loss(logp, behav, behav, adv, 1.0, cfg.model_copy(update={"kl_in": "loss"}), ref, seq_index)
    assert float(loss.detach()) == pytest.approx(-2.0 + 0.5 * (torch.tensor(d).exp().item() - d - 1))


def test_reward_mode_needs_the_sequences_of_the_tokens():
    cfg = TrainerConfig(kl_coef=0.1, kl_in="reward")
    with pytest.raises(ValueError, match="kl_in 'reward'.*seq_index"):
        ppo_loss(torch.zeros(2), torch.zeros(2), torch.zeros(2), torch.ones(2), 2.0, cfg, torch.zeros(2))


def test_the_trainer_folds_the_reference_kl_of_its_recompute_pass(tiny_model_dir):
    """Through the real Trainer (REINFORCE++ as the paper pairs it: reinforce_pp with kl_in reward): the reference
    model's logprobs of the recompute pass reach the fold, the logged KL is the k1 mean log(behaviour / reference)
    over the trained tokens, and the loss is not the one without the KL."""
    import numpy as np

    from areal_mq.algorithms.trainer import Trainer
    from tests.unit.algorithms.batches import behaviour_near_model, make_samples

    clean = behaviour_near_model(make_samples(5, n_groups=2, group_size=3), tiny_model_dir, noise=0.0)  # = reference
    noisy = behaviour_near_model(make_samples(5, n_groups=2, group_size=3), tiny_model_dir, noise=0.3, seed=1)
    want_kl = np.mean(np.concatenate([n.logprobs - c.logprobs for a, b in zip(noisy, clean)
                                      for n, c in zip(a.seqs, b.seqs)]))
    losses = {}
    for coef in (0.0, 0.5):
        cfg = TrainerConfig(lr=1e-3, max_tokens_per_mb=64, adv_estimator="reinforce_pp", kl_coef=coef,
                            kl_in="reward")
        m = Trainer(cfg, tiny_model_dir).train_step(noisy)
        losses[coef] = m["loss"]
        if coef:
            assert m["kl"] == pytest.approx(want_kl, rel=1e-4, abs=1e-5)
    assert np.isfinite(losses[0.5]) and losses[0.5] != pytest.approx(losses[0.0])
