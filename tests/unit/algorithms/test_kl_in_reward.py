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


# ---------------------------------------------------------------- kl_in reward_normalized (the paper's order)
def test_reward_normalized_returns_by_hand():
    """REINFORCE++ (Hu et al. 2025, arXiv 2501.03262) eq. 8-10 in OpenRLHF's order: G_t = R - beta * sum_{s>=t} KL_s,
    then A_t = (G_t - mean) / std over every token of the batch. Sequence 0: R = 1, KL = (0.5, -0.25, 1.0), beta
    0.1 -> G = (0.875, 0.925, 0.9); sequence 1 (another micro-batch): R = 0, KL = (2.0,) -> G = -0.2. Over the 4
    tokens: mean 0.625, population std sqrt(mean of squares 0.6059375 - 0.390625) = 0.46391..."""
    from areal_mq.algorithms.advantages import normalize_returns

    cfg = TrainerConfig(adv_estimator="reinforce_pp", kl_coef=0.1, kl_in="reward_normalized", adv_eps=1e-6)
    parts = [(torch.tensor([1.0, 1.0, 1.0]), torch.tensor([-1.0, -2.0, -0.5]), torch.tensor([-1.5, -1.75, -1.5]),
              torch.tensor([0, 0, 0])),
             (torch.tensor([0.0]), torch.tensor([-3.0]), torch.tensor([-5.0]), torch.tensor([0]))]
    g = [0.875, 0.925, 0.9, -0.2]
    mean = sum(g) / 4
    std = (sum(x * x for x in g) / 4 - mean * mean) ** 0.5
    want = [(x - mean) / (std + 1e-6) for x in g]
    got = normalize_returns(parts, cfg)
    assert [x for p in got for x in p.tolist()] == pytest.approx(want, rel=1e-6)
    centred = normalize_returns(parts, cfg.model_copy(update={"adv_std_norm": False}))
    assert [x for p in centred for x in p.tolist()] == pytest.approx([x - mean for x in g], rel=1e-6)
    seen = []
    normalize_returns(parts, cfg, all_reduce=lambda t: seen.append(t.tolist()))  # the ranks' sums: count, sum, squares
    assert seen == [pytest.approx([4.0, sum(g), sum(x * x for x in g)])]


def test_reward_normalized_needs_reinforce_pp_and_a_kl():
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="reward_normalized.*adv_estimator reinforce_pp"):
        TrainerConfig(kl_coef=0.1, kl_in="reward_normalized")
    with pytest.raises(ValidationError, match="kl_coef > 0"):
        TrainerConfig(adv_estimator="reinforce_pp", kl_in="reward_normalized")


def test_the_trainer_normalizes_the_returns_after_its_reference_pass(tiny_model_dir):
    """Through the real Trainer: the advantages the loss sees are the normalised returns of every trained token
    (mean 0, std 1 over the step, whatever the micro-batching), the loss differs from kl_in reward's order, and the
    logged KL is the same k1 mean."""
    import numpy as np

    from areal_mq.algorithms.trainer import Trainer
    from tests.unit.algorithms.batches import behaviour_near_model, make_samples

    noisy = behaviour_near_model(make_samples(5, n_groups=2, group_size=3), tiny_model_dir, noise=0.3, seed=1)
    results = {}
    for kl_in, budget in (("reward", 4096), ("reward_normalized", 4096), ("reward_normalized", 16)):
        cfg = TrainerConfig(lr=1e-3, max_tokens_per_mb=budget, adv_estimator="reinforce_pp", kl_coef=0.5, kl_in=kl_in,
                            packing="dynamic")
        trainer = Trainer(cfg, tiny_model_dir)
        _, minis, _, _ = trainer.prepare(noisy)
        trainer.recompute(minis)
        if kl_in == "reward_normalized":
            trainer._normalize_returns(minis)
            adv = torch.cat([mb.advantages for mini in minis for mb in mini]).double()
            assert float(adv.mean()) == pytest.approx(0.0, abs=1e-5) and float(adv.std(unbiased=False)) == \
                pytest.approx(1.0, rel=1e-4)
            results[kl_in, budget] = sorted(adv.tolist())
        m = Trainer(cfg, tiny_model_dir).train_step(noisy)
        assert np.isfinite(m["loss"]) and m["kl"] != 0  # k1 of noisy behaviour: either sign
        results[kl_in, "loss"] = m["loss"]
    assert results["reward_normalized", 16] == pytest.approx(results["reward_normalized", 4096], abs=1e-5)
    assert results["reward_normalized", "loss"] != pytest.approx(results["reward", "loss"])


def test_reinforce_pp_baseline_trains_through_the_real_trainer_in_the_papers_order(tiny_model_dir):
    """REINFORCE++-baseline with the KL in the returns: the trainer normalises the group-centred returns over the
    step (mean 0, std 1), and they are not REINFORCE++'s (whose returns keep each prompt's mean reward)."""
    import numpy as np

    from areal_mq.algorithms.trainer import Trainer
    from tests.unit.algorithms.batches import behaviour_near_model, make_samples

    noisy = behaviour_near_model(make_samples(5, n_groups=2, group_size=3), tiny_model_dir, noise=0.3, seed=1)
    advs = {}
    for estimator in ("reinforce_pp", "reinforce_pp_baseline"):
        cfg = TrainerConfig(lr=1e-3, max_tokens_per_mb=4096, adv_estimator=estimator, kl_coef=0.5,
                            kl_in="reward_normalized")
        trainer = Trainer(cfg, tiny_model_dir)
        _, minis, _, _ = trainer.prepare(noisy)
        trainer.recompute(minis)
        trainer._normalize_returns(minis)
        adv = torch.cat([mb.advantages for mini in minis for mb in mini]).double()
        assert float(adv.mean()) == pytest.approx(0.0, abs=1e-5)
        assert float(adv.std(unbiased=False)) == pytest.approx(1.0, rel=1e-4)
        advs[estimator] = adv.tolist()
        assert np.isfinite(Trainer(cfg, tiny_model_dir).train_step(noisy)["loss"])
    assert advs["reinforce_pp_baseline"] != pytest.approx(advs["reinforce_pp"], abs=1e-3)
