"""The objective seam (areal_mq/algorithms/objective.py, issue 60): registries chosen by config, today's loss
bit-identical through it, GSPO and the loss aggregations against hand-worked numbers, and micro-batch
accumulation equal to the whole-step formula."""
from __future__ import annotations

import math
import typing

import numpy as np
import pytest
import torch
from pydantic import ValidationError

from areal_mq.algorithms.advantages import ADVANTAGE_ESTIMATORS, group_advantages, step_advantages
from areal_mq.algorithms.config import TrainerConfig
from areal_mq.algorithms.objective import LOSS_AGGREGATIONS, POLICY_LOSSES, StepCounts
from areal_mq.algorithms.packing import SeqData, plan_step
from areal_mq.algorithms.ppo import ppo_loss
from tests.unit.algorithms import ppo_before_seam
from tests.unit.algorithms.batches import make_samples


def _batch(seed: int, n_seqs: int = 5, dtype=torch.float32):
    """Random tokens of `n_seqs` sequences: logp (with grad), prox, behav, ref, advantages, seq_index."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 7, (n_seqs,), generator=g)
    seq_index = torch.repeat_interleave(torch.arange(n_seqs), lengths)
    n = int(lengths.sum())
    logp = (-torch.rand(n, generator=g, dtype=dtype) * 3).requires_grad_()
    prox = logp.detach() + 0.3 * torch.randn(n, generator=g, dtype=dtype)
    behav = prox - 0.8 * torch.randn(n, generator=g, dtype=dtype)  # some weights beyond the cap of 5
    ref = logp.detach() + 0.2 * torch.randn(n, generator=g, dtype=dtype)
    adv = torch.randn(n_seqs, generator=g, dtype=dtype)[seq_index]
    return logp, prox, behav, ref, adv, seq_index


def _loss_and_grad(fn, logp, *args, **kwargs):
    logp.grad = None
    loss, stats = fn(logp, *args, **kwargs)
    loss.backward()
    return loss.detach().clone(), logp.grad.clone(), stats


CASES = [dict(behav_correction=False), dict(), dict(behav_weight_level="sequence"),
         dict(behav_weight_level="geometric"), dict(behav_cap_mode="mask", offpolicy_mask_k=2.0)]


@pytest.mark.parametrize("policy_loss", ["ppo", "cispo"])
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("kl_coef", [0.0, 0.1])
def test_default_seam_is_bit_identical_to_the_loss_before_it(policy_loss, case, kl_coef):
    cfg = TrainerConfig(policy_loss=policy_loss, kl_coef=kl_coef, **case)
    for seed in range(3):
        logp, prox, behav, ref, adv, seq_index = _batch(seed)
        if not cfg.behav_correction:  # as the trainer does: the proximal policy is the behaviour policy
            prox = behav
        args = (prox, behav, adv, 37.0, cfg, ref, seq_index)
        want_loss, want_grad, want_st = _loss_and_grad(ppo_before_seam.ppo_loss, logp, *args)
        got_loss, got_grad, got_st = _loss_and_grad(ppo_loss, logp, *args, total_seqs=5)
        assert torch.equal(got_loss, want_loss) and torch.equal(got_grad, want_grad)
        for name in ("clipped", "weight_sum", "weight_max", "capped", "masked", "kl_sum"):
            assert torch.equal(getattr(got_st, name), getattr(want_st, name)), name


def test_registries_are_the_config_choices():
    fields = TrainerConfig.model_fields
    assert set(typing.get_args(fields["policy_loss"].annotation)) == set(POLICY_LOSSES)
    assert set(typing.get_args(fields["loss_agg"].annotation)) == set(LOSS_AGGREGATIONS)
    assert set(typing.get_args(fields["adv_estimator"].annotation)) == set(ADVANTAGE_ESTIMATORS)


def test_unknown_names_are_refused_naming_the_field_and_the_known_names():
    with pytest.raises(ValidationError) as e:
        TrainerConfig(policy_loss="grpo")
    assert "policy_loss" in str(e.value) and "'gspo'" in str(e.value)
    with pytest.raises(ValidationError) as e:
        TrainerConfig(loss_agg="seq-mean")
    assert "loss_agg" in str(e.value) and "'seq-mean-token-mean'" in str(e.value)
    with pytest.raises(ValidationError, match="loss_agg_constant"):
        TrainerConfig(loss_agg="constant")


def test_default_advantage_estimator_is_group_advantages():
    cfg = TrainerConfig()
    groups = [np.array([1.0, 0.0, 0.0]), np.array([0.5]), np.array([2.0, 1.0])]
    for got, rewards in zip(step_advantages(groups, cfg), groups):
        np.testing.assert_array_equal(got, group_advantages(rewards, cfg))


# ---------------------------------------------------------------- GSPO
def test_gspo_two_sequences_by_hand():
    """GSPO (Zheng et al. 2025, arXiv 2507.18071): s_i = exp(1/|y_i| sum_t log(pi/pi_old)) (eq. 7), the objective
    min(s_i A_i, clip(s_i, 1-eps, 1+eps) A_i) (eq. 5), in its token form s_i,t = sg[s_i] pi(y_t)/sg[pi(y_t)]
    (GSPO-token, eq. 13-14). eps = 0.2 here for round numbers (the paper uses 3e-4 / 4e-4).

    Sequence 0, A = +1, two tokens with log-ratios ln 1.5 + 0.3 and ln 1.5 - 0.3: s = 1.5, clipped to 1.2;
      min(1.5, 1.2) = 1.2 is the clipped branch -> loss -1.2 a token, no gradient. (Per token PPO would clip
      only the first token, ratio 2.02, and keep the second, ratio 1.11.)
    Sequence 1, A = -1, one token with log-ratio ln 0.9: s = 0.9 inside [0.8, 1.2]; min(-0.9, -0.9) -> loss
      +0.9, gradient d(-s A)/d logp = s = 0.9.
    token-mean over 3 tokens: loss (-1.2 - 1.2 + 0.9) / 3 = -0.5, grads [0, 0, 0.3].
    seq-mean-token-mean over 2 sequences (the paper's 1/G sum_i 1/|y_i| sum_t): (-1.2 + 0.9) / 2 = -0.15,
      grads [0, 0, 0.45].
    """
    logp = torch.tensor([math.log(1.5) + 0.3, math.log(1.5) - 0.3, math.log(0.9)], dtype=torch.float64)
    prox = torch.zeros(3, dtype=torch.float64)
    adv = torch.tensor([1.0, 1.0, -1.0], dtype=torch.float64)
    seq_index = torch.tensor([0, 0, 1])
    for agg, total, want_loss, want_grad in [("token-mean", 3, -0.5, [0, 0, 0.3]),
                                             ("seq-mean-token-mean", 3, -0.15, [0, 0, 0.45])]:
        cfg = TrainerConfig(policy_loss="gspo", behav_correction=False, loss_agg=agg)
        x = logp.clone().requires_grad_()
        loss, st = ppo_loss(x, prox, prox, adv, total, cfg, seq_index=seq_index, total_seqs=2)
        loss.backward()
        assert loss.item() == pytest.approx(want_loss, abs=1e-12)
        assert x.grad.tolist() == pytest.approx(want_grad, abs=1e-12)
        assert st.clipped.item() == 2  # both tokens of sequence 0


def test_gspo_token_gradient_equals_the_sequence_objective():
    """With A_i,t = A_i, GSPO-token's gradient is GSPO's (arXiv 2507.18071, section 4.3): compare with the
    sequence-level objective (eq. 5) computed directly, s_i differentiated through its mean."""
    cfg = TrainerConfig(policy_loss="gspo", behav_correction=False, loss_agg="seq-mean-token-mean",
                        eps_clip_low=0.05, eps_clip_high=0.08)
    logp, prox, _, _, adv, seq_index = _batch(4, n_seqs=6, dtype=torch.float64)
    loss, _ = ppo_loss(logp, prox, prox, adv, 1.0, cfg, seq_index=seq_index, total_seqs=6)
    (got,) = torch.autograd.grad(loss, logp)
    lengths = torch.bincount(seq_index).double()
    s = torch.exp(torch.zeros(6, dtype=torch.float64).index_add(0, seq_index, logp - prox) / lengths)
    a = torch.zeros(6, dtype=torch.float64).index_add(0, seq_index, adv) / lengths
    direct = -torch.minimum(s * a, torch.clamp(s, 0.95, 1.08) * a).mean()
    (want,) = torch.autograd.grad(direct, logp)
    assert torch.allclose(loss, direct, atol=1e-12, rtol=0) and torch.allclose(got, want, atol=1e-12, rtol=0)


def test_gspo_without_seq_index_says_what_is_missing():
    logp, prox, _, _, adv, _ = _batch(0)
    with pytest.raises(ValueError, match="gspo.*seq_index"):
        ppo_loss(logp, prox, prox, adv, 1.0, TrainerConfig(policy_loss="gspo", behav_correction=False))


# ---------------------------------------------------------------- loss aggregation
def test_aggregations_by_hand():
    """Per-token losses [1, 2, 3 | 6] of two sequences. token-mean 12/4 = 3; seq-mean-token-mean (2 + 6)/2 = 4;
    seq-mean-token-sum (6 + 6)/2 = 6; constant (Dr. GRPO, arXiv 2503.20783 section 3.1, the sum over tokens
    divided by G x a constant, here 10): 12 / (2 x 10) = 0.6."""
    per_token = torch.tensor([1.0, 2.0, 3.0, 6.0])
    seq_index = torch.tensor([0, 0, 0, 1])
    counts = StepCounts(tokens=4, seqs=2)
    want = {"token-mean": 3.0, "seq-mean-token-mean": 4.0, "seq-mean-token-sum": 6.0, "constant": 0.6}
    for name, value in want.items():
        cfg = TrainerConfig(loss_agg=name, loss_agg_constant=10.0 if name == "constant" else None)
        assert LOSS_AGGREGATIONS[name](per_token, seq_index, counts, cfg).item() == pytest.approx(value), name


@pytest.mark.parametrize("agg", sorted(LOSS_AGGREGATIONS))
@pytest.mark.parametrize("policy_loss", sorted(POLICY_LOSSES))
def test_micro_batches_sum_to_the_whole_step(agg, policy_loss):
    """Split a step's sequences into two micro-batches (each numbering its sequences from 0, as build_microbatch
    does): the losses and gradients summed equal the one-batch loss, with the step's counts passed to both."""
    cfg = TrainerConfig(policy_loss=policy_loss, loss_agg=agg, loss_agg_constant=16.0, kl_coef=0.05,
                        behav_weight_level="geometric")
    logp, prox, behav, ref, adv, seq_index = _batch(7, n_seqs=6, dtype=torch.float64)
    n, cut = logp.numel(), int((seq_index < 2).sum())  # sequences 0-1 | 2-5
    whole, _ = ppo_loss(logp, prox, behav, adv, n, cfg, ref, seq_index, total_seqs=6)
    (want,) = torch.autograd.grad(whole, logp)
    parts = []
    for sl, first in [(slice(0, cut), 0), (slice(cut, n), 2)]:
        part, _ = ppo_loss(logp[sl], prox[sl], behav[sl], adv[sl], n, cfg, ref[sl], seq_index[sl] - first,
                           total_seqs=6)
        parts.append(part)
    total = parts[0] + parts[1]
    (got,) = torch.autograd.grad(total, logp)
    assert torch.allclose(total, whole, atol=1e-14, rtol=0) and torch.allclose(got, want, atol=1e-14, rtol=0)


def test_sequence_modes_need_the_step_sequence_count():
    logp, prox, _, _, adv, seq_index = _batch(0)
    cfg = TrainerConfig(loss_agg="seq-mean-token-sum", behav_correction=False)
    with pytest.raises(ValueError, match="total_seqs"):
        ppo_loss(logp, prox, prox, adv, 10.0, cfg, seq_index=seq_index)


def test_plan_counts_the_sequences_of_each_whole_minibatch():
    """The step's sequence count, like its token count, is of the whole mini-batch over every rank."""
    seqs = [SeqData(np.arange(3 + k, dtype=np.int64), 2, np.zeros(1 + k, np.float32), np.zeros(1 + k, np.int64),
                    0.0, f"s{k}") for k in range(7)]
    cfg = TrainerConfig(ppo_n_minibatches=2, packing="dynamic")
    plans = [plan_step(seqs, cfg, world_size=2, rank=r) for r in range(2)]
    assert plans[0].n_seqs == plans[1].n_seqs and sum(plans[0].n_seqs) == 7
    for k, mini in enumerate(plans[0].all_minibatch_seqs):
        assert plans[0].n_seqs[k] == len(mini)
        assert plans[0].gen_tokens[k] == sum(seqs[i].n_train for i in mini)


def test_trainer_gradient_does_not_depend_on_the_micro_batching(tiny_model_dir):
    """End to end through Trainer.prepare -> backward_minibatch: the step's sequence count reaches every
    micro-batch, so the accumulated gradient of many small micro-batches is that of a single one."""
    from areal_mq.algorithms.trainer import Trainer

    samples = make_samples(3, n_groups=2, group_size=3, gen_len=(2, 10))
    cfg = TrainerConfig(policy_loss="gspo", loss_agg="seq-mean-token-mean", max_tokens_per_mb=16,
                        packing="dynamic", device="cpu", precision="fp32")
    trainer = Trainer(cfg, tiny_model_dir)
    grads = {}
    for entropy_coef in (0.0, 0.5):  # the entropy bonus (differentiable entropy) accumulates the same way
        trainer.cfg.entropy_coef = entropy_coef
        for budget in (16, 4096):
            trainer.cfg.max_tokens_per_mb = budget
            _, minis, counts, _ = trainer.prepare(samples)
            assert counts[0].seqs == 6 and (len(minis[0]) > 1) == (budget == 16)
            trainer.backward_minibatch(minis[0], counts[0])
            grads[entropy_coef, budget] = {n: p.grad.clone() for n, p in trainer.unwrapped.named_parameters()
                                           if p.grad is not None}
    for entropy_coef in (0.0, 0.5):
        many, one = grads[entropy_coef, 16], grads[entropy_coef, 4096]
        assert many.keys() == one.keys() and many
        for name, value in one.items():  # fp32 sums in another order: 1e-4 of the tensor's largest entry
            torch.testing.assert_close(many[name], value, rtol=1e-4, atol=1e-4 * value.abs().max().item(), msg=name)
    head = "lm_head.weight" if "lm_head.weight" in one else next(iter(one))
    assert not torch.allclose(grads[0.0, 4096][head], grads[0.5, 4096][head])


# ---------------------------------------------------------------- entropy bonus
def test_entropy_bonus_by_hand():
    """loss -= entropy_coef x the aggregated entropy (verl's entropy_coeff): entropies [0.5, 1.5, 1.0], coef 0.1,
    token-mean over 3 tokens -> the loss drops by 0.1 x 1.0 and each entropy's gradient is -0.1 / 3."""
    logp, prox, _, _, adv, seq_index = _batch(0, n_seqs=1)
    logp, prox, adv, seq_index = logp[:3].detach(), prox[:3], adv[:3], seq_index[:3]
    entropy = torch.tensor([0.5, 1.5, 1.0], requires_grad=True)
    base, _ = ppo_loss(logp, prox, prox, adv, 3, TrainerConfig(behav_correction=False), seq_index=seq_index)
    cfg = TrainerConfig(behav_correction=False, entropy_coef=0.1)
    loss, _ = ppo_loss(logp, prox, prox, adv, 3, cfg, seq_index=seq_index, entropy=entropy)
    loss.backward()
    assert (loss - base).item() == pytest.approx(-0.1, abs=1e-6)
    assert entropy.grad.tolist() == pytest.approx([-0.1 / 3] * 3)
    with pytest.raises(ValueError, match="entropy_coef"):
        ppo_loss(logp, prox, prox, adv, 3, cfg, seq_index=seq_index)


def test_chunked_entropy_gradient_equals_the_full_logits_one():
    """The chunked LM head's entropy gradient (dH/dz = -p (log p + H)) equals autograd through full logits,
    at a temperature and with chunks smaller than the batch; logp and entropy both in the loss."""
    from areal_mq.algorithms.logprobs import chunked_logprobs, full_logprobs

    g = torch.Generator().manual_seed(0)
    hidden0, weight0 = torch.randn(7, 8, generator=g), torch.randn(50, 8, generator=g)
    bias0, targets = torch.randn(50, generator=g), torch.randint(0, 50, (7,), generator=g)
    mix = torch.randn(7, generator=g)
    out = []
    for fn, kw in [(full_logprobs, {}), (chunked_logprobs, {"chunk_tokens": 3})]:
        h, w, b = (t.clone().requires_grad_() for t in (hidden0, weight0, bias0))
        logp, entropy = fn(h, w, targets, 0.7, bias=b, entropy_grad=True, **kw)
        ((logp * mix).sum() + 0.3 * entropy.sum()).backward()
        out.append((entropy.detach(), h.grad, w.grad, b.grad))
    for want, got in zip(*out):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
