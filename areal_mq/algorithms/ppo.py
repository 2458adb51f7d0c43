"""The decoupled PPO loss (AReaL, arXiv 2505.24298), per token, as pure tensor math.

What: for each generated token with advantage A, behaviour logprob b (recorded by the rollout
engine), proximal logprob p (recomputed with the trainer's weights when the batch arrived) and the
current logprob θ:

    r = exp(θ - p)                       # PPO ratio against the proximal policy
    w = exp(p - b)                       # behaviour importance weight, capped (truncate = TIS) or masked
    w = exp(sum_seq(p - b)) or exp(mean_seq(p - b))   # trainer.behav_weight_level sequence / geometric:
                                         # every token of a sequence gets its sequence's weight
    w = 0 where w ∉ [1/k, k]             # IcePop masking (trainer.offpolicy_mask_k = k; off by default)
    loss_token = -w * policy_loss(θ, p, A) + kl_coef * KL(θ || ref) - entropy_coef * H(π_θ at the token)
                 # trainer.kl_in reward instead: no KL term, A_t -= kl_coef * sum_{s>=t} (b_s - ref_s) (`kl_in_reward`)
                 # trainer.policy_loss: "ppo" min(r*A, clip(r, 1-eps_low, 1+eps_high) * A), "cispo", "gspo"
                 # (areal_mq/algorithms/objective.py POLICY_LOSSES; r = exp(θ - p))

The batch loss aggregates loss_token by trainer.loss_agg (objective.py LOSS_AGGREGATIONS); the default,
token-mean, is sum(loss_token) / total_tokens where `total_tokens` is the number of generated
tokens of the WHOLE optimizer step (every micro-batch, every data-parallel rank), so accumulating
micro-batch gradients gives exactly the gradient of the token mean (the sequence modes divide by the step's
`total_seqs` the same way). Tokens masked out (behaviour cap in
mode "mask", or outside [1/k, k]) contribute zero but stay in the denominator. Where each correction comes
from: the field descriptions in areal_mq/algorithms/config.py.
The statistics stay 0-dim tensors on the loss's device: the trainer sums them over micro-batches and reads
them back once per step (a `float()` per micro-batch would make the host wait for the GPU every time).
Why here: kept free of models and distributed code so it can be checked by hand (tests/unit/algorithms).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from areal_mq.algorithms.config import TrainerConfig
from areal_mq.algorithms.objective import (LOCAL, LOSS_AGGREGATIONS, POLICY_LOSSES, SequenceSums, StepCounts,
                                           _need_seq_index, sequence_log_weight)

__all__ = ["LossStats", "behaviour_weight", "kl_in_reward", "kl_penalty", "ppo_loss", "sequence_log_weight", "suffix_sums",
           "surrogate"]


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


def behaviour_weight(prox_logp: torch.Tensor, behav_logp: torch.Tensor, cfg: TrainerConfig,
                     seq_index: torch.Tensor | None = None, sums: SequenceSums = LOCAL):
    """(weight used in the loss, raw weight, keep-mask, capped-mask) for the behaviour correction.
    `seq_index` ([N], the sequence of each token) is needed for behav_weight_level sequence / geometric, whose
    sums cover each sequence wherever it lies (`sums`: objective.py SequenceSums)."""
    log_w = prox_logp - behav_logp
    if cfg.behav_correction and cfg.behav_weight_level != "token":
        if seq_index is None or seq_index.shape != log_w.shape:
            raise ValueError(f"behav_weight_level {cfg.behav_weight_level!r} needs the sequence of every token "
                             "(seq_index, the same length as the logprobs)")
        log_w = sequence_log_weight(log_w, seq_index, cfg.behav_weight_level, sums)
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


def surrogate(logp: torch.Tensor, prox_logp: torch.Tensor, advantages: torch.Tensor, cfg: TrainerConfig,
              seq_index: torch.Tensor | None = None, sums: SequenceSums = LOCAL):
    """(per-token policy loss before the behaviour weight, clipped-mask) of trainer.policy_loss."""
    return POLICY_LOSSES[cfg.policy_loss](logp, prox_logp, advantages, cfg, seq_index, sums=sums)


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token KL(π_θ || π_ref) estimate from sampled tokens (k1 or the non-negative k3)."""
    if estimator == "k1":
        return logp - ref_logp
    log_ratio = ref_logp - logp
    return torch.exp(log_ratio) - log_ratio - 1.0


def suffix_sums(x: torch.Tensor, seq_index: torch.Tensor, sums: SequenceSums = LOCAL) -> torch.Tensor:
    """Per token t of sequence i, sum over the tokens s >= t of sequence i of x_s. The tokens of a sequence are
    contiguous and in order, sequences numbered 0..S-1 in order (seq_index non-decreasing), as packing.py lays
    them out: the suffix sum over the whole micro-batch minus what the later sequences hold, plus what the later
    cp ranks hold of sequence i (`sums.later`: their columns come after this rank's). float64 inside; a constant."""
    x64 = x.double()
    after_t = x64.flip(0).cumsum(0).flip(0)  # sum over s >= t of the whole micro-batch
    totals = sums.own(x64, seq_index)
    later = totals.sum() - totals.cumsum(0)  # sum over the sequences after i
    out = after_t - later[seq_index]
    beyond = sums.later(totals)
    if beyond is not None:
        out = out + beyond[seq_index]
    return out.to(x.dtype)


def kl_in_reward(advantages: torch.Tensor, behav_logp: torch.Tensor, ref_logp: torch.Tensor,
                 seq_index: torch.Tensor | None, kl_coef: float,
                 sums: SequenceSums = LOCAL) -> tuple[torch.Tensor, torch.Tensor]:
    """trainer.kl_in reward: the KL to the reference as a per-token reward, folded into the advantage as
    REINFORCE++ does (arXiv 2501.03262, eq. 8-9): A_t = A_seq - kl_coef * sum_{s >= t} KL_s, with the k1 estimate
    KL_s = log pi_old(y_s) - log pi_ref(y_s) where pi_old is the policy that sampled the token (the behaviour
    logprobs) — a constant, no gradient flows through it. Over the trained tokens only (an episode's environment
    tokens have no logprob). Returns (the advantages, the summed KL as a 0-dim float32)."""
    kl = behav_logp - ref_logp
    seq_index = _need_seq_index(seq_index, kl, "trainer.kl_in 'reward'")
    return advantages - kl_coef * suffix_sums(kl, seq_index, sums), kl.sum().float()


def ppo_loss(
    logp: torch.Tensor,
    prox_logp: torch.Tensor,
    behav_logp: torch.Tensor,
    advantages: torch.Tensor,
    total_tokens: float,
    cfg: TrainerConfig,
    ref_logp: torch.Tensor | None = None,
    seq_index: torch.Tensor | None = None,
    total_seqs: float | None = None,
    entropy: torch.Tensor | None = None,
    sums: SequenceSums = LOCAL,
) -> tuple[torch.Tensor, LossStats]:
    """Loss of one micro-batch's generated tokens, already normalised by the step's counts (trainer.loss_agg).

    All tensors are 1-d over the same tokens ([N]); only `logp` carries gradient. With
    behav_correction off, the proximal policy IS the behaviour policy (pass behav_logp as prox_logp).
    `seq_index` ([N] long): the sequence (0..S-1) of each token, for trainer.behav_weight_level != token,
    policy_loss gspo and loss_agg seq-mean-token-mean. `total_tokens` / `total_seqs`: generated tokens /
    sequences of the whole optimizer step (total_seqs is needed by the loss_agg modes other than token-mean).
    `entropy` ([N], with gradient): the policy's entropy at each token, for trainer.entropy_coef > 0.
    `sums`: how a per-sequence statistic sums its sequence (objective.py SequenceSums): LOCAL when this process
    holds whole sequences, ulysses.CpSequenceSums when the tokens are a cp rank's slice of a packed row (the loss
    then counts this rank's tokens only; the cp ranks' losses and gradients add up to the whole row's).
    """
    if total_tokens <= 0:
        raise ValueError(f"total_tokens must be > 0, got {total_tokens}")
    prox_logp = prox_logp.detach()
    weight, raw, keep, capped = behaviour_weight(prox_logp, behav_logp.detach(), cfg, seq_index, sums)
    kl_sum = logp.new_zeros((), dtype=torch.float32)
    if cfg.kl_coef > 0 and ref_logp is not None and cfg.kl_in == "reward_normalized":
        kl_sum = (behav_logp.detach() - ref_logp.detach()).sum().float()  # already in the advantages: logged only
    if cfg.kl_coef > 0 and ref_logp is not None and cfg.kl_in == "reward":
        advantages, kl_sum = kl_in_reward(advantages, behav_logp.detach(), ref_logp.detach(), seq_index, cfg.kl_coef,
                                          sums)
    policy, clipped = surrogate(logp, prox_logp, advantages, cfg, seq_index, sums)
    per_token = weight * policy
    if cfg.kl_coef > 0 and ref_logp is not None and cfg.kl_in == "loss":
        kl = kl_penalty(logp, ref_logp.detach(), cfg.kl_estimator)
        per_token = per_token + cfg.kl_coef * kl
        kl_sum = kl.detach().sum().float()
    if cfg.entropy_coef > 0:
        if entropy is None or entropy.shape != logp.shape:
            raise ValueError("trainer.entropy_coef > 0 needs the entropy of every token (entropy, the same length "
                             "as the logprobs, with gradient)")
        per_token = per_token - cfg.entropy_coef * entropy
    loss = LOSS_AGGREGATIONS[cfg.loss_agg](per_token, seq_index, StepCounts(total_tokens, total_seqs), cfg, sums)
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
