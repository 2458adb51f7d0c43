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
gives exactly the whole-step formula. Under context parallelism (cp > 1) a process holds only a slice of a packed
row, so a sequence may lie across ranks: every per-sequence statistic (gspo's s_i, a sequence's token count, the
sequence-level behaviour weights, kl_in reward's suffix sums) goes through a `SequenceSums`, the seam cp swaps
(ulysses.CpSequenceSums adds the other cp ranks' parts); each rank's loss still counts its own tokens only.
Which peer recipe is which setting: docs/recipes.md.
Why: a new objective is one function and one registry entry, not another `if` inside the loss.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from areal_mq.algorithms.config import TrainerConfig


class SequenceSums:
    """Per-sequence totals of per-token values, where the tokens a process holds are whole sequences (cp 1): its own
    sums are the totals. The seam context parallelism swaps (ulysses.CpSequenceSums: the same sums all-reduced over
    the cp group, since a sequence may lie across its ranks); `LOCAL` is this one."""

    def slots(self, seq_index: torch.Tensor) -> int:
        """How many sequence numbers a per-sequence tensor has room for: the token count (S <= N), known on the host
        (sizing it by `seq_index.max()` would copy that value back from the device, a sync per micro-batch on CUDA)."""
        return seq_index.numel()

    def own(self, values: torch.Tensor, seq_index: torch.Tensor) -> torch.Tensor:
        """[slots] the sum of `values` ([N]) over this process's tokens of each sequence number of `seq_index` ([N],
        0..S-1); index it with `seq_index`."""
        return values.new_zeros(self.slots(seq_index)).index_add_(0, seq_index, values)

    def totals(self, values: torch.Tensor, seq_index: torch.Tensor) -> torch.Tensor:
        """[slots] the sum of `values` over every token of each sequence, wherever it lies (here: `own`)."""
        return self.own(values, seq_index)

    def later(self, own: torch.Tensor) -> torch.Tensor | None:
        """[slots] of each sequence, what the ranks after this one hold (their tokens come later in the sequence),
        given this rank's `own` sums; None: no other rank holds any."""
        return None


LOCAL = SequenceSums()


def sequence_log_weight(log_w: torch.Tensor, seq_index: torch.Tensor, level: str,
                        sums: SequenceSums = LOCAL) -> torch.Tensor:
    """Per token, the log weight of its sequence: the sum (level "sequence") or the mean ("geometric") of the
    token log weights `log_w` over the tokens with the same `seq_index` (sequence numbers 0..S-1), over every
    token of the sequence wherever it lies (`sums`). A constant: callers pass detached log weights."""
    total = sums.totals(log_w, seq_index)
    if level == "geometric":
        count = sums.totals(torch.ones_like(log_w), seq_index)
        total = total / count.clamp(min=1)
    return total[seq_index]


def _need_seq_index(seq_index: torch.Tensor | None, like: torch.Tensor, what: str) -> torch.Tensor:
    if seq_index is None or seq_index.shape != like.shape:
        raise ValueError(f"{what} needs the sequence of every token (seq_index, the same length as the logprobs)")
    return seq_index


# ---------------------------------------------------------------- policy losses
def ppo_policy(logp, prox_logp, advantages, cfg: TrainerConfig, seq_index=None, sums=LOCAL):
    """The clipped surrogate: a clipped token gets no gradient."""
    ratio = torch.exp(logp - prox_logp)
    clipped_ratio = torch.clamp(ratio, 1.0 - cfg.eps_clip_low, 1.0 + cfg.eps_clip_high)
    surr, surr_clipped = ratio * advantages, clipped_ratio * advantages
    return -torch.minimum(surr, surr_clipped), (surr_clipped < surr).detach()


def cispo_policy(logp, prox_logp, advantages, cfg: TrainerConfig, seq_index=None, sums=LOCAL):
    """CISPO: the clipped ratio is a constant weight of the logprob's gradient; every token keeps a gradient."""
    ratio = torch.exp(logp - prox_logp)
    clipped_ratio = torch.clamp(ratio, 1.0 - cfg.eps_clip_low, 1.0 + cfg.eps_clip_high)
    return -clipped_ratio.detach() * advantages * logp, clipped_ratio.detach() != ratio.detach()


def gspo_policy(logp, prox_logp, advantages, cfg: TrainerConfig, seq_index=None, sums=LOCAL):
    """GSPO-token (arXiv 2507.18071, eq. 13-14): every token of sequence i carries the length-normalised sequence
    ratio s_i as its value, clipped at the sequence level, while its gradient is s_i * grad(θ_t) (eq. 15). s_i is
    a constant (sg): only its value needs the whole sequence (`sums`); the gradient flows through each token's θ_t."""
    seq_index = _need_seq_index(seq_index, logp, "policy_loss 'gspo'")
    log_s = sequence_log_weight((logp - prox_logp).detach(), seq_index, "geometric", sums)
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


def token_mean(per_token, seq_index, counts: StepCounts, cfg: TrainerConfig, sums=LOCAL):
    return per_token.sum() / counts.tokens


def seq_mean_token_mean(per_token, seq_index, counts: StepCounts, cfg: TrainerConfig, sums=LOCAL):
    seq_index = _need_seq_index(seq_index, per_token, "loss_agg 'seq-mean-token-mean'")
    length = sums.totals(torch.ones_like(per_token), seq_index)  # the whole sequence's token count (a constant)
    return (per_token / length[seq_index]).sum() / _seqs(counts, cfg.loss_agg)


def seq_mean_token_sum(per_token, seq_index, counts: StepCounts, cfg: TrainerConfig, sums=LOCAL):
    return per_token.sum() / _seqs(counts, cfg.loss_agg)


def constant_norm(per_token, seq_index, counts: StepCounts, cfg: TrainerConfig, sums=LOCAL):
    return per_token.sum() / (_seqs(counts, cfg.loss_agg) * cfg.loss_agg_constant)


LossAggregation = Callable[..., torch.Tensor]
LOSS_AGGREGATIONS: dict[str, LossAggregation] = {
    "token-mean": token_mean, "seq-mean-token-mean": seq_mean_token_mean,
    "seq-mean-token-sum": seq_mean_token_sum, "constant": constant_norm,
}

