"""The off-policy corrections of the loss (issue 27 item 3) against values computed by hand.

TIS (behav_cap_mode truncate), IcePop masking (offpolicy_mask_k) and CISPO (policy_loss cispo) on the four
tokens of test_ppo_loss.py, whose behaviour weights exp(prox - behav) are e^-0.3 ≈ 0.741, 1, 3 and e^0.1 ≈ 1.105
and whose ratios exp(theta - prox) are e^0.5 (above 1 + eps_high), e^-0.5 (below 1 - eps_low), e^0.1, e^-0.1.
"""
from __future__ import annotations

import math

import pytest
import torch
from pydantic import ValidationError

from areal_mq.algorithms.config import TrainerConfig, validate_off_policy
from areal_mq.algorithms.ppo import ppo_loss
from areal_mq.errors import ConfigError
from tests.unit.algorithms.test_ppo_loss import ADV, BEHAV, EPS_HIGH, EPS_LOW, PROX, THETA

W = [math.exp(p - b) for p, b in zip(PROX, BEHAV)]  # 0.741, 1, 3, 1.105
R = [math.exp(t - p) for t, p in zip(THETA, PROX)]  # 1.649, 0.607, 1.105, 0.905


def _cfg(**kw) -> TrainerConfig:
    return TrainerConfig(**{"eps_clip_low": EPS_LOW, "eps_clip_high": EPS_HIGH, **kw})


def _run(cfg: TrainerConfig, total: float = 4, theta=THETA, prox=PROX, behav=BEHAV):
    th = torch.tensor(theta, dtype=torch.float64).requires_grad_(True)
    t = lambda xs: torch.tensor(xs, dtype=torch.float64)  # noqa: E731
    loss, stats = ppo_loss(th, t(prox), t(behav), t(ADV), total, cfg)
    loss.backward()
    return loss.item(), th.grad.tolist(), stats


def _ppo_token(i: int, w: float) -> tuple[float, float]:
    """PPO loss term and gradient of token i with behaviour weight w, by hand."""
    r, a = R[i], ADV[i]
    unclipped, clipped = r * a, min(max(r, 1 - EPS_LOW), 1 + EPS_HIGH) * a
    return -w * min(unclipped, clipped), (-w * a * r if unclipped <= clipped else 0.0)


def test_tis_is_the_truncating_cap():
    """TIS with C = 2: min(w, 2) per token; only token 2 (w = 3) is truncated, and it keeps a gradient."""
    loss, grad, stats = _run(_cfg(behav_weight_cap=2.0, behav_cap_mode="truncate"))
    terms = [_ppo_token(i, min(W[i], 2.0)) for i in range(4)]
    assert loss == pytest.approx(sum(t for t, _ in terms) / 4, rel=1e-12)
    assert grad == pytest.approx([g / 4 for _, g in terms], rel=1e-12)
    assert grad[2] == pytest.approx(-2.0 * ADV[2] * R[2] / 4)
    assert stats.capped == 1 and stats.masked == 0


@pytest.mark.parametrize("k, masked", [(1.3, {0, 2}), (2.0, {2}), (4.0, set())])
def test_icepop_masks_tokens_whose_weight_leaves_the_band(k, masked):
    """Band [1/k, k]: k = 1.3 masks w = 0.741 (< 0.769) and w = 3; k = 2 only w = 3; k = 4 none. The kept tokens
    keep their (capped) weight; the masked ones give no loss and no gradient but stay in the denominator."""
    loss, grad, stats = _run(_cfg(behav_weight_cap=5.0, offpolicy_mask_k=k))
    terms = [(0.0, 0.0) if i in masked else _ppo_token(i, W[i]) for i in range(4)]
    assert loss == pytest.approx(sum(t for t, _ in terms) / 4, rel=1e-12)
    assert grad == pytest.approx([g / 4 for _, g in terms], rel=1e-12, abs=1e-15)
    assert all(grad[i] == 0.0 for i in masked)
    assert stats.masked == len(masked)
    # a masked token is not counted as clipped (token 0 is clipped by the ratio, but gives nothing at k = 1.3)
    assert stats.clipped == len({0, 1} - masked)


def test_icepop_keeps_every_on_policy_token():
    """Synchronous data (behaviour == proximal, w = 1) is never masked, whatever k > 1."""
    _, _, stats = _run(_cfg(offpolicy_mask_k=1.01), behav=PROX)
    assert stats.masked == 0


def test_icepop_and_the_cap_mask_together_count_each_token_once():
    """behav_cap_mode mask with cap 2 masks token 2; k = 1.3 masks tokens 0 and 2: two tokens masked in all."""
    loss, _, stats = _run(_cfg(behav_weight_cap=2.0, behav_cap_mode="mask", offpolicy_mask_k=1.3))
    assert stats.masked == 2 and stats.capped == 1
    assert loss == pytest.approx((_ppo_token(1, W[1])[0] + _ppo_token(3, W[3])[0]) / 4, rel=1e-12)


def test_cispo_keeps_a_gradient_on_clipped_tokens():
    """CISPO: loss_i = -w_i * sg(clip(r_i)) * A_i * theta_i, so d/dtheta_i = -w_i * clip(r_i) * A_i: tokens 0 and 1
    (ratio clipped to 1.3 and 0.8) keep a gradient where PPO's is 0; tokens 2, 3 have PPO's gradient."""
    cap = 2.0
    loss, grad, stats = _run(_cfg(behav_weight_cap=cap, policy_loss="cispo"))
    w = [min(x, cap) for x in W]
    clip = [1 + EPS_HIGH, 1 - EPS_LOW, R[2], R[3]]
    assert loss == pytest.approx(sum(-w[i] * clip[i] * ADV[i] * THETA[i] for i in range(4)) / 4, rel=1e-12)
    assert grad == pytest.approx([-w[i] * clip[i] * ADV[i] / 4 for i in range(4)], rel=1e-12)
    assert grad[0] == pytest.approx(-math.exp(-0.3) * 1.3 / 4) and grad[1] == pytest.approx(0.8 / 4)  # A = -1
    assert [g for g in grad[2:]] == pytest.approx([_ppo_token(i, w[i])[1] / 4 for i in (2, 3)], rel=1e-12)
    assert stats.clipped == 2  # tokens whose ratio left [1 - eps_low, 1 + eps_high], whatever A's sign


def test_cispo_with_icepop_masks_before_weighting():
    loss, grad, stats = _run(_cfg(behav_weight_cap=5.0, policy_loss="cispo", offpolicy_mask_k=1.3))
    assert grad[0] == 0.0 and grad[2] == 0.0
    assert grad[1] == pytest.approx(-W[1] * (1 - EPS_LOW) * ADV[1] / 4)
    assert grad[3] == pytest.approx(-W[3] * R[3] * ADV[3] / 4, rel=1e-12)
    assert stats.masked == 2 and stats.clipped == 1  # token 1 only: token 0 is masked


def test_cispo_on_policy_gradient_equals_ppo_inside_the_clip_range():
    """At theta == prox == behav (r = 1, w = 1) both losses have the policy-gradient -A per token."""
    _, g_ppo, _ = _run(_cfg(), theta=PROX, behav=PROX)
    _, g_cispo, _ = _run(_cfg(policy_loss="cispo"), theta=PROX, behav=PROX)
    assert g_cispo == pytest.approx(g_ppo, rel=1e-12) and g_ppo == pytest.approx([-a / 4 for a in ADV])


@pytest.mark.parametrize("kw, match", [
    (dict(offpolicy_mask_k=1.0), "greater than 1"),
    (dict(offpolicy_mask_k=0.5), "greater than 1"),
    (dict(behav_weight_cap=0.5), "greater than or equal to 1"),
    (dict(offpolicy_mask_k=2.0, behav_correction=False), "1 everywhere with behav_correction=false"),
    (dict(policy_loss="m2po"), "ppo"),
])
def test_meaningless_settings_are_refused(kw, match):
    with pytest.raises(ValidationError, match=match):
        TrainerConfig(**kw)


def test_async_without_the_correction_is_still_refused_whatever_the_loss():
    for cfg in (_cfg(behav_correction=False, policy_loss="cispo"), _cfg(behav_correction=False)):
        with pytest.raises(ConfigError, match="allow_uncorrected_off_policy"):
            validate_off_policy(2, cfg)
        validate_off_policy(0, cfg)  # synchronous: nothing to correct
    validate_off_policy(4, _cfg(behav_correction=False, allow_uncorrected_off_policy=True))
    validate_off_policy(4, _cfg(offpolicy_mask_k=2.0, policy_loss="cispo"))
