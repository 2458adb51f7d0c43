"""Rewards -> per-sequence advantages: the advantage estimators, a registry chosen by trainer.adv_estimator.

What: an estimator takes the step's groups of rewards (one array per prompt) and returns one advantage per
sequence, group by group; it sees the whole step so that a batch-level estimator fits the same seam.
`group` (the default, GRPO): every `Sample` is one prompt's group of n rewarded sequences. Rewards are transformed
(`clip((r + reward_bias) * reward_scale, ±reward_clip)`), a baseline is subtracted inside the group
(the group mean, the leave-one-out mean of the others, or none), and optionally the result is divided
by the group's std (population std + adv_eps). Every generated token of a sequence gets its
sequence's advantage. A group of one sequence has no baseline to compare against: advantage 0
(unless adv_baseline is "none").
`reinforce_pp` (REINFORCE++, Hu et al. 2025, arXiv 2501.03262, eq. 10 in the versions read): no per-prompt baseline; every sequence's
transformed reward minus the mean over ALL sequences of the step, divided by their std (population std + adv_eps;
adv_std_norm false: the mean is subtracted only). adv_baseline is the group estimator's and is not used here.
The paper also folds a token-level KL into the reward: trainer.kl_in reward folds it after this normalisation
(areal_mq/algorithms/ppo.py); trainer.kl_in reward_normalized before it, per token, in the paper's order
(`normalize_returns`, run by the trainer after its reference pass).
`reinforce_pp_baseline` (REINFORCE++-baseline, the variant of the same paper's later versions for prompts sampled
several times; OpenRLHF's `reinforce_baseline`): each sequence's transformed reward minus its group's mean first (the
per-prompt baseline), then the same normalisation over every sequence of the step, which divides by the batch's
std rather than each group's (GRPO's). A group of one has nothing to compare against: 0, as in `group`.
Data-parallel ranks: every rank receives the whole step's sample list (workers/trainer.py broadcasts it) and
computes the advantages here, before packing.py splits the sequences between ranks, so the "global batch" is the
whole step on every rank and the normalisation is the same everywhere, with no collective.
Why: pure numpy, so it can be checked by hand and runs identically on every data-parallel rank.
"""
from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from areal_mq.algorithms.config import TrainerConfig


def transform_rewards(rewards: np.ndarray, cfg: TrainerConfig) -> np.ndarray:
    """clip((r + bias) * scale) as float64."""
    out = (np.asarray(rewards, dtype=np.float64) + cfg.reward_bias) * cfg.reward_scale
    if cfg.reward_clip is not None:
        out = np.clip(out, -cfg.reward_clip, cfg.reward_clip)
    return out


def group_advantages(rewards: np.ndarray, cfg: TrainerConfig) -> np.ndarray:
    """Advantages of one group's sequences (same order as `rewards`)."""
    r = transform_rewards(rewards, cfg)
    n = len(r)
    if n == 0:
        return r
    if cfg.adv_baseline == "none":
        adv = r.copy()
    elif n == 1:
        return np.zeros(1)
    elif cfg.adv_baseline == "group_mean":
        adv = r - r.mean()
    else:  # leave_one_out: baseline of sequence i is the mean of the other n-1
        adv = r - (r.sum() - r) / (n - 1)
    if cfg.adv_std_norm and n > 1:
        adv = adv / (r.std() + cfg.adv_eps)
    return adv



def group_estimator(groups: Sequence[np.ndarray], cfg: TrainerConfig) -> list[np.ndarray]:
    """`group_advantages` of every group of the step, independently."""
    return [group_advantages(r, cfg) for r in groups]


def reinforce_pp_estimator(groups: Sequence[np.ndarray], cfg: TrainerConfig) -> list[np.ndarray]:
    """REINFORCE++: the step's transformed rewards normalised over the whole batch, returned group by group.
    With trainer.kl_in reward_normalized the transformed rewards themselves: the KL is folded in and the batch
    normalisation done per token once the reference logprobs exist (`normalize_returns`)."""
    rewards = [transform_rewards(r, cfg) for r in groups]
    if cfg.kl_in == "reward_normalized":
        return rewards
    return _batch_normalised(rewards, cfg)


def reinforce_pp_baseline_estimator(groups: Sequence[np.ndarray], cfg: TrainerConfig) -> list[np.ndarray]:
    """REINFORCE++-baseline: every group's transformed rewards centred on their own mean, then normalised over the
    whole step (`reinforce_pp_estimator`'s normalisation of the centred values; with trainer.kl_in
    reward_normalized the centred values, normalised per token after the reference pass)."""
    centred = [r - r.mean() if len(r) > 1 else np.zeros(len(r)) for r in (transform_rewards(g, cfg) for g in groups)]
    if cfg.kl_in == "reward_normalized":
        return centred
    return _batch_normalised(centred, cfg)


def _batch_normalised(values: list[np.ndarray], cfg: TrainerConfig) -> list[np.ndarray]:
    """(v - mean) / (std + adv_eps) with the mean and population std over every value of the step (adv_std_norm
    false: minus the mean only), returned group by group."""
    flat = np.concatenate(values) if values else np.zeros(0)
    if flat.size == 0:
        return values
    mean, scale = flat.mean(), (flat.std() + cfg.adv_eps if cfg.adv_std_norm else 1.0)
    return [(v - mean) / scale for v in values]


def normalize_returns(parts: Sequence[tuple], cfg: TrainerConfig, all_reduce: Callable | None = None,
                      sums: Sequence | None = None) -> list:
    """trainer.kl_in reward_normalized, REINFORCE++ in the paper's order (arXiv 2501.03262 eq. 8-10; OpenRLHF):
    per trained token t of a sequence with transformed reward R, the return G_t = R - kl_coef x sum_{s >= t} KL_s
    (k1: KL_s = behaviour logp - reference logp, no discount), then A_t = (G_t - mean) / (std + adv_eps) with the
    mean and (population) std over every trained token of the step, every micro-batch and every rank.

    `parts`: one (rewards [N], behav_logp [N], ref_logp [N], seq_index [N]) per micro-batch, torch tensors, the
    rewards each token's sequence's R. `all_reduce(tensor)` sums a float64 tensor over the data-parallel ranks
    (None: one rank). `sums`: one objective.SequenceSums per part (None: LOCAL each); under context parallelism
    (ulysses.CpSequenceSums) a part is this rank's slice of a packed row, and a token's suffix sum adds what the later
    cp ranks hold of its sequence; the step's mean and std then count each cp rank's own tokens, disjoint, through
    `all_reduce`. Returns the advantages per part (float32). Every rank must call it (a collective)."""
    import torch

    from areal_mq.algorithms.objective import LOCAL
    from areal_mq.algorithms.ppo import suffix_sums

    sums = list(sums) if sums is not None else [LOCAL] * len(parts)
    returns = [r.double() - cfg.kl_coef * suffix_sums((b - ref).double(), i, part_sums)
               for (r, b, ref, i), part_sums in zip(parts, sums)]
    stats = torch.zeros(3, dtype=torch.float64, device=returns[0].device if returns else None)
    for g in returns:
        stats += torch.stack([g.new_tensor(float(g.numel())), g.sum(), (g * g).sum()])
    if all_reduce is not None:
        all_reduce(stats)
    count, total, squares = stats.tolist()
    if count == 0:
        return [g.float() for g in returns]
    mean = total / count
    scale = (max(squares / count - mean * mean, 0.0) ** 0.5 + cfg.adv_eps) if cfg.adv_std_norm else 1.0
    return [((g - mean) / scale).float() for g in returns]


AdvantageEstimator = Callable[[Sequence[np.ndarray], TrainerConfig], list[np.ndarray]]
ADVANTAGE_ESTIMATORS: dict[str, AdvantageEstimator] = {"group": group_estimator, "reinforce_pp": reinforce_pp_estimator,
                                                       "reinforce_pp_baseline": reinforce_pp_baseline_estimator}


def step_advantages(groups: Sequence[np.ndarray], cfg: TrainerConfig) -> list[np.ndarray]:
    """The advantages of the step's groups by trainer.adv_estimator."""
    return ADVANTAGE_ESTIMATORS[cfg.adv_estimator](groups, cfg)
