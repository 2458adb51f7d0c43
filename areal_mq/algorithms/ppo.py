"""The decoupled PPO loss (AReaL, arXiv 2505.24298), per token, as pure tensor math.

What: for each generated token with advantage A, behaviour logprob b (recorded by the rollout
engine), proximal logprob p (recomputed with the trainer's weights when the batch arrived) and the
current logprob θ:

    r = exp(θ - p)                       # PPO ratio against the proximal policy
    w = exp(p - b)                       # behaviour importance weight, capped (truncate) or masked
    loss_token = -w * min(r*A, clip(r, 1-eps_low, 1+eps_high) * A)

The batch loss is sum(loss_token) / total_tokens where `total_tokens` is the number of generated
tokens of the WHOLE optimizer step (every micro-batch, every data-parallel rank), so accumulating
micro-batch gradients gives exactly the gradient of the token mean. Tokens masked out by the
behaviour cap (mode "mask") contribute zero but stay in the denominator.
The statistics stay 0-dim tensors on the loss's device: the trainer sums them over micro-batches and reads
them back once per step (a `float()` per micro-batch would make the host wait for the GPU every time).
Why here: kept free of models and distributed code so it can be checked by hand (tests/unit/algorithms).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from areal_mq.algorithms.config import TrainerConfig


@dataclass
class LossStats:
    """Sums over the tokens of one micro-batch (divide by token counts after reducing over ranks).
    Every field but `n_tokens` is a 0-dim float tensor on the loss's device (no host sync)."""

    n_tokens: int
    clipped: torch.Tensor  # tokens where the clipped surrogate was the active one
    weight_sum: torch.Tensor  # sum of the behaviour weight (before cap) over tokens
    weight_max: torch.Tensor  # 0 when there is no token
    capped: torch.Tensor  # tokens whose weight exceeded the cap (truncated or masked)
    kl_sum: torch.Tensor


def behaviour_weight(prox_logp: torch.Tensor, behav_logp: torch.Tensor, cfg: TrainerConfig):
    """(weight used in the loss, raw weight, keep-mask, capped-mask) for the behaviour correction."""
    raw = torch.exp(prox_logp - behav_logp)
    ones = torch.ones_like(raw, dtype=torch.bool)
    if not cfg.behav_correction:
        return torch.ones_like(raw), raw, ones, ~ones
    cap = cfg.behav_weight_cap
    if cap is None:
        return raw, raw, ones, ~ones
    capped = raw > cap
    if cfg.behav_cap_mode == "truncate":
        return torch.clamp(raw, max=cap), raw, ones, capped
    return torch.where(capped, torch.zeros_like(raw), raw), raw, ~capped, capped


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token KL(π_θ || π_ref) estimate from sampled tokens (k1 or the non-negative k3)."""
    if estimator == "k1":
        return logp - ref_logp
    log_ratio = ref_logp - logp
    return torch.exp(log_ratio) - log_ratio - 1.0


def ppo_loss(
    logp: torch.Tensor,
    prox_logp: torch.Tensor,
    behav_logp: torch.Tensor,
    advantages: torch.Tensor,
    total_tokens: float,
    cfg: TrainerConfig,
    ref_logp: torch.Tensor | None = None,
) -> tuple[torch.Tensor, LossStats]:
    """Loss of one micro-batch's generated tokens, already normalised by the step's `total_tokens`.

    All tensors are 1-d over the same tokens ([N]); only `logp` carries gradient. With
    behav_correction off, the proximal policy IS the behaviour policy (pass behav_logp as prox_logp).
    """
    if total_tokens <= 0:
        raise ValueError(f"total_tokens must be > 0, got {total_tokens}")
    prox_logp = prox_logp.detach()
    weight, raw, keep, capped = behaviour_weight(prox_logp, behav_logp.detach(), cfg)
    ratio = torch.exp(logp - prox_logp)
    surr = ratio * advantages
    clipped_ratio = torch.clamp(ratio, 1.0 - cfg.eps_clip_low, 1.0 + cfg.eps_clip_high)
    surr_clipped = clipped_ratio * advantages
    per_token = -weight * torch.minimum(surr, surr_clipped)
    kl_sum = logp.new_zeros((), dtype=torch.float32)
    if cfg.kl_coef > 0 and ref_logp is not None:
        kl = kl_penalty(logp, ref_logp.detach(), cfg.kl_estimator)
        per_token = per_token + cfg.kl_coef * kl
        kl_sum = kl.detach().sum().float()
    loss = per_token.sum() / total_tokens
    with torch.no_grad():
        stats = LossStats(
            n_tokens=logp.numel(),
            clipped=((surr_clipped < surr) & keep).sum().float(),
            weight_sum=raw.sum().float(),
            weight_max=raw.max().float() if raw.numel() else raw.new_zeros((), dtype=torch.float32),
            capped=capped.sum().float(),
            kl_sum=kl_sum,
        )
    return loss, stats
