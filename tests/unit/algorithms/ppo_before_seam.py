"""A frozen copy of areal_mq/algorithms/ppo.py as it was before issue 60 (the objective seam).

What: the decoupled PPO loss exactly as it was computed before the policy loss, advantage estimator and loss
aggregation became registries. Why: tests/unit/algorithms/test_objective.py asserts the seam's default losses and
gradients are bit-identical to this. Do not edit: it is the recorded behaviour, not the code in use.
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
    masked: torch.Tensor  # tokens that contribute no loss: over the cap in mode "mask", or outside [1/k, k]
    kl_sum: torch.Tensor


def sequence_log_weight(log_w: torch.Tensor, seq_index: torch.Tensor, level: str) -> torch.Tensor:
    """Per token, the log weight of its sequence: the sum (level "sequence") or the mean ("geometric") of the
    token log weights `log_w` over the tokens with the same `seq_index` (sequence numbers 0..S-1).

    The sums are sized by the token count (S <= N), known on the host: sizing them by `seq_index.max()` would
    copy that value back from the device, a sync in every micro-batch on CUDA."""
    slots = seq_index.numel()
    total = log_w.new_zeros(slots).index_add_(0, seq_index, log_w)
    if level == "geometric":
        count = log_w.new_zeros(slots).index_add_(0, seq_index, torch.ones_like(log_w))
        total = total / count.clamp(min=1)
    return total[seq_index]


def behaviour_weight(prox_logp: torch.Tensor, behav_logp: torch.Tensor, cfg: TrainerConfig,
                     seq_index: torch.Tensor | None = None):
    """(weight used in the loss, raw weight, keep-mask, capped-mask) for the behaviour correction.
    `seq_index` ([N], the sequence of each token) is needed for behav_weight_level sequence / geometric."""
    log_w = prox_logp - behav_logp
    if cfg.behav_correction and cfg.behav_weight_level != "token":
        if seq_index is None or seq_index.shape != log_w.shape:
            raise ValueError(f"behav_weight_level {cfg.behav_weight_level!r} needs the sequence of every token "
                             "(seq_index, the same length as the logprobs)")
        log_w = sequence_log_weight(log_w, seq_index, cfg.behav_weight_level)
    raw = torch.exp(log_w)
    ones = torch.ones_like(raw, dtype=torch.bool)
    if not cfg.behav_correction:
        return torch.ones_like(raw), raw, ones, ~ones
    weight, keep, capped = raw, ones, ~ones
    cap = cfg.behav_weight_cap
    if cap is not None:
        capped = raw > cap
        if cfg.behav_cap_mode == "truncate":
            weight = torch.clamp(raw, max=cap)
        else:
            keep = ~capped
    k = cfg.offpolicy_mask_k
    if k is not None:
        keep = keep & (raw >= 1.0 / k) & (raw <= k)
    if (cap is not None and cfg.behav_cap_mode == "mask") or k is not None:
        weight = torch.where(keep, weight, torch.zeros_like(weight))
    return weight, raw, keep, capped


def surrogate(logp: torch.Tensor, ratio: torch.Tensor, advantages: torch.Tensor, cfg: TrainerConfig):
    """(per-token policy loss before the behaviour weight, clipped-mask) of trainer.policy_loss."""
    clipped_ratio = torch.clamp(ratio, 1.0 - cfg.eps_clip_low, 1.0 + cfg.eps_clip_high)
    if cfg.policy_loss == "cispo":  # the clipped ratio is a constant weight of the logprob's gradient
        return -clipped_ratio.detach() * advantages * logp, clipped_ratio.detach() != ratio.detach()
    surr, surr_clipped = ratio * advantages, clipped_ratio * advantages
    return -torch.minimum(surr, surr_clipped), (surr_clipped < surr).detach()


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
    seq_index: torch.Tensor | None = None,
) -> tuple[torch.Tensor, LossStats]:
    """Loss of one micro-batch's generated tokens, already normalised by the step's `total_tokens`.

    All tensors are 1-d over the same tokens ([N]); only `logp` carries gradient. With
    behav_correction off, the proximal policy IS the behaviour policy (pass behav_logp as prox_logp).
    `seq_index` ([N] long): the sequence (0..S-1) of each token, for trainer.behav_weight_level != token.
    """
    if total_tokens <= 0:
        raise ValueError(f"total_tokens must be > 0, got {total_tokens}")
    prox_logp = prox_logp.detach()
    weight, raw, keep, capped = behaviour_weight(prox_logp, behav_logp.detach(), cfg, seq_index)
    policy, clipped = surrogate(logp, torch.exp(logp - prox_logp), advantages, cfg)
    per_token = weight * policy
    kl_sum = logp.new_zeros((), dtype=torch.float32)
    if cfg.kl_coef > 0 and ref_logp is not None:
        kl = kl_penalty(logp, ref_logp.detach(), cfg.kl_estimator)
        per_token = per_token + cfg.kl_coef * kl
        kl_sum = kl.detach().sum().float()
    loss = per_token.sum() / total_tokens
    with torch.no_grad():
        stats = LossStats(
            n_tokens=logp.numel(),
            clipped=(clipped & keep).sum().float(),
            weight_sum=raw.sum().float(),
            weight_max=raw.max().float() if raw.numel() else raw.new_zeros((), dtype=torch.float32),
            capped=capped.sum().float(),
            masked=(~keep).sum().float(),
            kl_sum=kl_sum,
        )
    return loss, stats
