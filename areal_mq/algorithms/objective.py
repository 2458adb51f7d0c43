"""The seam of the training objective: policy losses and loss aggregations, each a name -> a small function.

What: `POLICY_LOSSES[trainer.policy_loss]` turns one micro-batch's tokens into (per-token loss, clipped-mask);
`LOSS_AGGREGATIONS[trainer.loss_agg]` turns per-token losses into the micro-batch's share of the step's loss.
The third registry, the advantage estimator, is numpy and lives in areal_mq/algorithms/advantages.py. ppo.py
(`ppo_loss`) applies the decoupled-PPO behaviour weight and the KL penalty around whichever policy loss is
chosen, then aggregates. With r = exp(θ - p) (θ: current logprob, p: proximal) and A the token's advantage:

    ppo    -min(r*A, clip(r)*A)                                  (clip: [1 - eps_clip_low, 1 + eps_clip_high])
    cispo  -sg(clip(r)) * A * θ                                  (MiniMax-M1, arXiv 2506.13585)
    gspo   -min(s*A, clip(s)*A),  s = sg(s_i) * exp(θ - sg(θ)),  s_i = exp(mean over sequence i of (θ - p))
                                                                 (Zheng et al. 2025, arXiv 2507.18071, GSPO-token)

    token-mean           sum(loss) / T                  T: generated tokens of the whole optimizer step
    seq-mean-token-mean  sum_i(mean_t(loss_i,t)) / S    S: sequences of the whole optimizer step
    seq-mean-token-sum   sum(loss) / S
    constant             sum(loss) / (S * loss_agg_constant)     (Dr. GRPO, arXiv 2503.20783)

Every sequence lies whole inside one micro-batch, so a sequence's token count is known here, and the step-level
T and S (over micro-batches and data-parallel ranks) come from the step plan: summing the micro-batches' losses
gives exactly the whole-step formula. Which peer recipe is which setting: docs/recipes.md.
Why: a new objective is one function and one registry entry, not another `if` inside the loss.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from areal_mq.algorithms.config import TrainerConfig


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


def _need_seq_index(seq_index: torch.Tensor | None, like: torch.Tensor, what: str) -> torch.Tensor:
    if seq_index is None or seq_index.shape != like.shape:
        raise ValueError(f"{what} needs the sequence of every token (seq_index, the same length as the logprobs)")
    return seq_index


# ---------------------------------------------------------------- policy losses
def ppo_policy(logp, prox_logp, advantages, cfg: TrainerConfig, seq_index=None):
    """The clipped surrogate: a clipped token gets no gradient."""
    ratio = torch.exp(logp - prox_logp)
    clipped_ratio = torch.clamp(ratio, 1.0 - cfg.eps_clip_low, 1.0 + cfg.eps_clip_high)
    surr, surr_clipped = ratio * advantages, clipped_ratio * advantages
    return -torch.minimum(surr, surr_clipped), (surr_clipped < surr).detach()


def cispo_policy(logp, prox_logp, advantages, cfg: TrainerConfig, seq_index=None):
    """CISPO: the clipped ratio is a constant weight of the logprob's gradient; every token keeps a gradient."""
    ratio = torch.exp(logp - prox_logp)
    clipped_ratio = torch.clamp(ratio, 1.0 - cfg.eps_clip_low, 1.0 + cfg.eps_clip_high)
    return -clipped_ratio.detach() * advantages * logp, clipped_ratio.detach() != ratio.detach()


def gspo_policy(logp, prox_logp, advantages, cfg: TrainerConfig, seq_index=None):
    """GSPO-token (arXiv 2507.18071, eq. 13-14): every token of sequence i carries the length-normalised sequence
    ratio s_i as its value, clipped at the sequence level, while its gradient is s_i * grad(θ_t) (eq. 15)."""
    seq_index = _need_seq_index(seq_index, logp, "policy_loss 'gspo'")
    log_s = sequence_log_weight((logp - prox_logp).detach(), seq_index, "geometric")
    ratio = torch.exp(log_s + (logp - logp.detach()))  # value s_i, d/dθ_t = s_i
    clipped_ratio = torch.clamp(ratio, 1.0 - cfg.eps_clip_low, 1.0 + cfg.eps_clip_high)
    surr, surr_clipped = ratio * advantages, clipped_ratio * advantages
    return -torch.minimum(surr, surr_clipped), (surr_clipped < surr).detach()


PolicyLoss = Callable[..., tuple[torch.Tensor, torch.Tensor]]
POLICY_LOSSES: dict[str, PolicyLoss] = {"ppo": ppo_policy, "cispo": cispo_policy, "gspo": gspo_policy}


# ---------------------------------------------------------------- loss aggregations
@dataclass(frozen=True)
class StepCounts:
    """What the whole optimizer step holds (every micro-batch, every data-parallel rank): the loss's denominators."""

    tokens: float  # generated (trained) tokens
    seqs: float | None = None  # sequences with at least one trained token


def _seqs(counts: StepCounts, mode: str) -> float:
    if counts.seqs is None or counts.seqs <= 0:
        raise ValueError(f"loss_agg {mode!r} divides by the step's number of sequences: pass total_seqs > 0 "
                         f"(got {counts.seqs})")
    return counts.seqs


def token_mean(per_token, seq_index, counts: StepCounts, cfg: TrainerConfig):
    return per_token.sum() / counts.tokens


def seq_mean_token_mean(per_token, seq_index, counts: StepCounts, cfg: TrainerConfig):
    seq_index = _need_seq_index(seq_index, per_token, "loss_agg 'seq-mean-token-mean'")
    length = per_token.new_zeros(seq_index.numel()).index_add_(0, seq_index, torch.ones_like(per_token))
    return (per_token / length[seq_index]).sum() / _seqs(counts, cfg.loss_agg)


def seq_mean_token_sum(per_token, seq_index, counts: StepCounts, cfg: TrainerConfig):
    return per_token.sum() / _seqs(counts, cfg.loss_agg)


def constant_norm(per_token, seq_index, counts: StepCounts, cfg: TrainerConfig):
    return per_token.sum() / (_seqs(counts, cfg.loss_agg) * cfg.loss_agg_constant)


LossAggregation = Callable[..., torch.Tensor]
LOSS_AGGREGATIONS: dict[str, LossAggregation] = {
    "token-mean": token_mean, "seq-mean-token-mean": seq_mean_token_mean,
    "seq-mean-token-sum": seq_mean_token_sum, "constant": constant_norm,
}

