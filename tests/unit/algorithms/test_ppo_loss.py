"""The decoupled PPO loss against values computed by hand (plain Python math, not the same torch code)."""
from __future__ import annotations

import math

import pytest
import torch

from areal_mq.algorithms.config import TrainerConfig
from areal_mq.algorithms.ppo import kl_penalty, ppo_loss

# four tokens chosen to hit: ratio above 1+eps_high (A>0, clipped), ratio below 1-eps_low (A<0, clipped),
# a behaviour weight of 3 above the cap of 2 (unclipped ratio), and a plain unclipped token.
THETA = [-1.0, -2.0, -0.5, -1.0]
PROX = [-1.5, -1.5, -0.6, -0.9]
BEHAV = [-1.2, -1.5, -0.6 - math.log(3.0), -1.0]
ADV = [1.0, -1.0, 0.5, -2.0]
EPS_LOW, EPS_HIGH, CAP = 0.2, 0.3, 2.0


def _cfg(**kw) -> TrainerConfig:
    base = dict(eps_clip_low=EPS_LOW, eps_clip_high=EPS_HIGH, behav_weight_cap=CAP)
    base.update(kw)
    return TrainerConfig(**base)


def _hand(mode: str | None, correction: bool = True) -> tuple[list[float], list[float]]:
    """Per-token loss terms and d(loss_token)/d(theta) computed by hand."""
    losses, grads = [], []
    for th, p, b, a in zip(THETA, PROX, BEHAV, ADV):
        r = math.exp(th - p)
        w = math.exp(p - b) if correction else 1.0
        if correction and mode == "truncate":
            w = min(w, CAP)
        elif correction and mode == "mask" and w > CAP:
            w = 0.0
        unclipped, clipped = r * a, min(max(r, 1 - EPS_LOW), 1 + EPS_HIGH) * a
        losses.append(-w * min(unclipped, clipped))
        grads.append(-w * a * r if unclipped <= clipped else 0.0)  # clipped branch has no gradient
    return losses, grads


def _run(cfg: TrainerConfig, total: float, behav=BEHAV, idx=slice(None)):
    theta = torch.tensor(THETA, dtype=torch.float64)[idx].clone().requires_grad_(True)
    t = lambda xs: torch.tensor(xs, dtype=torch.float64)[idx]  # noqa: E731
    loss, stats = ppo_loss(theta, t(PROX), t(behav), t(ADV), total, cfg)
    loss.backward()
    return loss.item(), theta.grad.tolist(), stats


@pytest.mark.parametrize("mode", ["truncate", "mask"])
def test_loss_and_gradient_match_hand_computation(mode):
    losses, grads = _hand(mode)
    loss, grad, stats = _run(_cfg(behav_cap_mode=mode), total=4)
    assert loss == pytest.approx(sum(losses) / 4, rel=1e-12)
    assert grad == pytest.approx([g / 4 for g in grads], rel=1e-12)
    # tokens 0 (r=e^0.5 > 1.3, A>0) and 1 (r=e^-0.5 < 0.8, A<0) are clipped; token 2 is over the cap
    assert stats.clipped == 2 and stats.capped == 1
    assert float(stats.weight_max) == pytest.approx(3.0)
    assert grad[0] == 0.0 and grad[1] == 0.0


def test_cap_modes_differ_only_on_the_capped_token():
    trunc, _ = _hand("truncate")
    masked, _ = _hand("mask")
    assert trunc[2] == pytest.approx(-2.0 * math.exp(0.1) * 0.5)
    assert masked[2] == 0.0
    assert [trunc[i] for i in (0, 1, 3)] == [masked[i] for i in (0, 1, 3)]


def test_no_cap_uses_the_raw_weight():
    loss, _, stats = _run(_cfg(behav_weight_cap=None), total=4)
    w = [math.exp(p - b) for p, b in zip(PROX, BEHAV)]
    expect = 0.0
    for th, p, a, wi in zip(THETA, PROX, ADV, w):
        r = math.exp(th - p)
        expect += -wi * min(r * a, min(max(r, 1 - EPS_LOW), 1 + EPS_HIGH) * a)
    assert loss == pytest.approx(expect / 4, rel=1e-12)
    assert stats.capped == 0


def test_correction_off_is_plain_ppo_with_weight_one():
    losses, _ = _hand(None, correction=False)
    loss, _, _ = _run(_cfg(behav_correction=False), total=4)
    assert loss == pytest.approx(sum(losses) / 4, rel=1e-12)


def test_token_mean_is_over_the_whole_batch_not_per_micro_batch():
    """Two micro-batches of 1 and 3 tokens normalised by the batch total equal the whole batch,
    while per-micro-batch means would weigh the lone token 3x too much."""
    cfg = _cfg()
    whole, grad_whole, _ = _run(cfg, total=4)
    a, ga, _ = _run(cfg, total=4, idx=slice(0, 1))
    b, gb, _ = _run(cfg, total=4, idx=slice(1, 4))
    assert a + b == pytest.approx(whole, rel=1e-12)
    assert ga + gb == pytest.approx(grad_whole, rel=1e-12)
    per_mb_mean = _run(cfg, total=1, idx=slice(0, 1))[0] + _run(cfg, total=3, idx=slice(1, 4))[0]
    assert per_mb_mean != pytest.approx(whole)


def test_kl_estimators_by_hand():
    logp, ref = torch.tensor([-1.0, -2.0]), torch.tensor([-1.5, -1.0])
    assert kl_penalty(logp, ref, "k1").tolist() == pytest.approx([0.5, -1.0])
    k3 = [math.exp(-0.5) + 0.5 - 1, math.exp(1.0) - 1.0 - 1]
    assert kl_penalty(logp, ref, "k3").tolist() == pytest.approx(k3)


def test_kl_term_is_added_with_its_coefficient():
    cfg = _cfg(kl_coef=0.1, kl_estimator="k1")
    theta = torch.tensor(THETA, dtype=torch.float64)
    ref = theta - 0.25  # k1 = 0.25 on every token
    t = lambda xs: torch.tensor(xs, dtype=torch.float64)  # noqa: E731
    with_kl, stats = ppo_loss(theta, t(PROX), t(BEHAV), t(ADV), 4, cfg, ref_logp=ref)
    without, _ = ppo_loss(theta, t(PROX), t(BEHAV), t(ADV), 4, _cfg())
    assert with_kl.item() - without.item() == pytest.approx(0.1 * 0.25)
    assert float(stats.kl_sum) == pytest.approx(1.0)


def test_zero_total_tokens_is_refused():
    with pytest.raises(ValueError, match="total_tokens"):
        ppo_loss(torch.zeros(1), torch.zeros(1), torch.zeros(1), torch.zeros(1), 0, _cfg())
