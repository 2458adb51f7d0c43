"""Sequence (context) parallelism, Ulysses-style: one long packed row's activations divided over `cp` ranks.

What: the `cp` ranks of a context-parallel group see the SAME packed micro-batch (one row of L tokens, dynamic or
shared packing) and each computes L/cp of its tokens through every layer, so a rank holds 1/cp of the row's
activations (the part that grows with the answer length). Around each attention call two all-to-alls regroup the
row (DeepSpeed-Ulysses, arXiv 2309.14509):

    rank r: q, k, v [1, H, L/cp, D]  (its tokens, all heads; RoPE already applied from its own position ids)
        -- all-to-all -->  [1, H/cp, L, D]  (every token, heads r*H/cp .. (r+1)*H/cp - 1; KV heads likewise)
        attention over the whole row for those heads (attention.py's varlen_attention: one causal call per block)
        -- all-to-all -->  [1, L/cp, H, D]  (its tokens again, all heads) -> o_proj, MLP, norms: per token, local

The row's blocks (one per sequence of a dynamic row, a prompt and its completions in a shared one, plus the padding)
are known in whole-row columns to every rank (`CpRow.segments`), so the attention is exactly the unsplit row's.
`_AllToAll` is an autograd Function whose backward is the inverse all-to-all. Both `dist.all_to_all_single` (used
here, one buffer) and the list form `dist.all_to_all` work on gloo in torch 2.13 (checked on CPU); NCCL has both.
Query heads AND KV heads must divide by cp (each rank keeps whole GQA groups): `check_heads` says which do not.

Slicing (`slice_microbatch`, pure index arithmetic): the row is padded to a multiple of cp (pad tokens form one
causal block of their own after the real ones, never attended by a real token, never scored) and rank r keeps
columns [r L'/cp, (r+1) L'/cp). A trained token is scored by the logits of the column BEFORE it, and the micro-batch
already carries each token's target with that scoring column (packing.py: keep_cols / logit_index / targets), so
a token goes to the rank holding its scoring column, target and loss data (behaviour logprobs, advantages,
versions, proximal and reference logprobs) with it: the shift happens before the split, and the token whose
context ends at a slice's last column is scored right though its target sits on the next rank.

Loss and gradients: each rank's loss is the partial sum over its tokens (the trainer's token-level loss is
normalised by the step's global token count, so the slices' losses add up to the row's). Parameters are
replicated over the cp group; a rank's backward already carries every rank's loss into its activations (the
all-to-all backward), so the row's gradient of a parameter is the SUM of the cp ranks' gradients:
`reduce_cp_grads` all-reduces them (sum) over the group. Call it only where the data-parallel reduction does not
already span the cp ranks: DDP over the whole dp x cp world with the loss scaled by that world's size, or FSDP
sharded over dp x cp (torchtitan's dp_shard_cp), sums over cp inside its own reduction.

How the trainer uses it (trainer.parallel.cp > 1; areal_mq/algorithms/trainer.py): FSDP2 shards over dp_shard only
(ParallelDims.dp_mesh never includes cp), so the cp ranks of a pair hold the same shards and the trainer sums their
gradients itself, through `ContextParallel` (one handle, every call a no-op at cp 1):
    check_objective(trainer_cfg, cp)      # at the trainer's start: the settings a slice cannot compute (see Limits)
    cp = ContextParallel(parallel.cp_group())
    cp.attach(lm)                         # after trainer.attention's setup, for the policy and the reference model
    mb = cp.shard(mb, pad_id)             # each micro-batch after packing (Trainer.prepare), before recompute
    token_logprobs(model, mb, ...)        # unchanged: policy.py passes mb.segments (a CpRow) to every attention call
    ppo_loss(..., sums=cp.sequence_sums(mb))  # per-sequence statistics over the whole row (below)
    loss.backward() per micro-batch, then cp.reduce_grads(model) once per mini-batch, before unscaling and clipping
A sum is linear: once per optimizer step is enough, and it commutes with DDP's or FSDP's data-parallel reduction
(which runs inside backward). A cp group of 1 makes them all no-ops. Metrics: a rank's sums cover its tokens only
(`n_tokens` its real tokens), so a sum over the cp ranks counts each once.

Sequence-level objectives: a sequence may cross a slice boundary, so a per-sequence statistic is a sum of the cp
ranks' partial sums. `CpSequenceSums` (objective.py's SequenceSums seam) sums each rank's tokens per sequence number
(the micro-batch's numbering, the same on every rank) and all-reduces them over the group: a sequence's token count
(loss_agg seq-mean-token-mean), gspo's log s_i = mean(θ - p) and behav_weight_level sequence / geometric's sum or
mean of (p - b); kl_in reward's suffix sum adds what the later ranks hold of the token's sequence (`later`: their
columns come after). Every one of these is a constant of the loss (detached logprobs: gspo's gradient is s_i x
grad θ_t, through each token's own θ_t), so a plain sum is exact; `totals` still all-reduces through an autograd
Function whose backward is the same sum (d/dx_r of sum_r' L_r'(sum_r x_r) = sum_r' dL_r'/dy), so a statistic that
carried a gradient would stay right. Each rank's loss then counts its own tokens, and the cp ranks' losses and summed
gradients are the whole row's. kl_in reward_normalized's returns (advantages.normalize_returns)
take the same suffix sums, and its mean and std count each rank's own tokens. Limits (`check_objective`): padded
micro-batches, and shared rows under attention sdpa.

Run: pytest tests/unit/algorithms/test_ulysses.py tests/integration/test_ulysses.py (cp 2 on 2 CPU ranks over gloo
against one process: logprobs, loss and every gradient to 1e-5); tests/integration/test_trainer_tp_cp.py (the Trainer
at cp 2 against one process, its checkpoint resumed at tp 2); tests/integration/test_ulysses_objectives.py (the
sequence-level objectives at cp 2 against one process: the Trainer over two steps, ppo_loss case by case).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist

from areal_mq.algorithms.attention import Segment, _mask, varlen_attention
from areal_mq.algorithms.objective import LOCAL, SequenceSums
from areal_mq.algorithms.packing import MicroBatch
from areal_mq.errors import ConfigError

ATTN = "areal_ulysses"  # the name registered in transformers' attention and mask interfaces


@dataclass
class CpRow:
    """One packed row split over a cp group, as one rank holds it (a sharded MicroBatch's `segments`).

    segments  # the padded row's blocks in whole-row columns (attention.py's Segment), the padding a block of its own
    length  # the padded row's length L' (a multiple of cp); this rank holds columns [start, start + L'/cp)
    token_index  # [n] long: which of the unsplit micro-batch's N trained tokens are this rank's (ascending)
    group  # the cp process group (None: sliced only, e.g. in a test; attention then needs one)
    """

    segments: list[Segment]
    length: int
    start: int
    token_index: torch.Tensor
    group: Any = None


def cp_size(group: Any) -> int:
    """Ranks in `group` (None: the default group; 1 when no process group is initialised)."""
    if group is None and not dist.is_initialized():
        return 1
    return dist.get_world_size(group)


def check_heads(config: Any, cp: int) -> None:
    """A clear error unless cp divides the model's query heads and key/value heads."""
    heads = config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    if heads % cp or kv % cp:
        fits = [d for d in range(1, kv + 1) if heads % d == 0 and kv % d == 0]
        raise ConfigError(
            f"Ulysses context parallelism: cp {cp} must divide the model's num_attention_heads {heads} and "
            f"num_key_value_heads {kv} (each rank attends with whole heads and whole GQA groups); "
            f"pick cp among {fits}")


def check_objective(cfg: Any, cp: int) -> None:
    """A clear error when trainer settings (a TrainerConfig) need what a slice cannot see at cp > 1: a statistic over
    a whole sequence that CpSequenceSums does not reach, or a row layout slice_microbatch refuses. Meant for config
    time, beside check_heads. (loss_agg seq-mean-token-mean, policy_loss gspo, behav_weight_level sequence /
    geometric and kl_in reward / reward_normalized are summed over the cp group: CpSequenceSums.)"""
    if cp == 1:
        return
    bad = []
    if cfg.packing == "padded":
        bad.append("packing padded (Ulysses splits one packed row)")
    if cfg.packing == "shared" and cfg.attention != "varlen":
        bad.append("packing shared with attention sdpa (its rows carry an L x L mask; use attention varlen)")
    if bad:
        raise ConfigError(f"Ulysses context parallelism (cp {cp}) splits a sequence over ranks, so each rank sees "
                          f"only part of it; these trainer settings are not built for that: {'; '.join(bad)}. "
                          "Change them or train with cp 1")


# ---------------------------------------------------------------- slicing (index arithmetic, no communication)
def row_segments(mb: MicroBatch) -> list[Segment]:
    """The blocks of a packed row: its `segments` (trainer.attention varlen), else one per sequence of a dynamic row,
    found where the position ids do not continue (as transformers does for packed rows)."""
    if mb.input_ids.shape[0] != 1:
        raise ConfigError(f"Ulysses context parallelism takes one packed row, got a padded micro-batch of "
                          f"{mb.input_ids.shape[0]} rows: use trainer.packing dynamic or shared")
    if mb.segments is not None:
        return list(mb.segments)
    if mb.attention_mask is not None:
        raise ConfigError("Ulysses context parallelism: this packed row carries an L x L mask (shared packing under "
                          "trainer.attention sdpa); use trainer.attention varlen, whose rows carry their blocks")
    pos = mb.position_ids[0]
    starts = [0] + (torch.nonzero(pos[1:] - pos[:-1] != 1).flatten() + 1).tolist() + [pos.numel()]
    return [(a, b, []) for a, b in zip(starts[:-1], starts[1:])]


def slice_microbatch(mb: MicroBatch, rank: int, cp: int, group: Any = None, pad_id: int = 0) -> MicroBatch:
    """Rank `rank`'s share of the packed row `mb` split over `cp` ranks (see the module docstring): its L'/cp
    columns of input ids and position ids, the trained tokens its columns score with their targets and loss data,
    and a CpRow as `segments`. Run once per micro-batch (one host sync for the token selection)."""
    segments = row_segments(mb)
    length = mb.input_ids.shape[1]
    padded = -(-length // cp) * cp
    pad = padded - length
    ids, pos = mb.input_ids, mb.position_ids
    if pad:
        ids = torch.cat([ids, ids.new_full((1, pad), pad_id)], dim=1)
        pos = torch.cat([pos, torch.arange(pad, dtype=pos.dtype, device=pos.device)[None]], dim=1)
        segments.append((length, padded, []))
    width = padded // cp
    start, end = rank * width, (rank + 1) * width
    cols = mb.keep_cols[mb.logit_index]  # [N] the column whose logits score each trained token
    token_index = torch.nonzero((cols >= start) & (cols < end)).flatten()
    local_cols = cols[token_index] - start
    keep = torch.unique(local_cols)  # sorted
    per_token = {name: None if getattr(mb, name) is None else getattr(mb, name)[token_index]
                 for name in ("targets", "behav_logp", "advantages", "versions", "seq_index", "prox_logp", "ref_logp")}
    return replace(mb, input_ids=ids[:, start:end], position_ids=pos[:, start:end], attention_mask=None,
                   keep_cols=keep, logit_index=torch.searchsorted(keep, local_cols), **per_token,
                   n_tokens=max(0, min(end, length) - start),
                   segments=CpRow(segments, padded, start, token_index, group))


def shard_microbatch(mb: MicroBatch, group: Any, pad_id: int = 0) -> MicroBatch:
    """This rank's share of `mb` over the cp process `group`; `mb` itself when the group has one rank."""
    cp = cp_size(group)
    if cp == 1:
        return mb
    return slice_microbatch(mb, dist.get_rank(group), cp, group, pad_id)


# ---------------------------------------------------------------- communication
def _all_to_all(x: torch.Tensor, scatter_dim: int, gather_dim: int, group: Any) -> torch.Tensor:
    """Chunk i of `x` along scatter_dim goes to rank i; the chunks received are concatenated along gather_dim
    in rank order."""
    cp = dist.get_world_size(group)
    send = torch.stack(x.chunk(cp, dim=scatter_dim))  # [cp, ...]: contiguous, chunk i for rank i
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return torch.cat(recv.unbind(0), dim=gather_dim)


class _AllToAll(torch.autograd.Function):
    """`_all_to_all` with the inverse all-to-all (gather_dim scattered, scatter_dim gathered) as its backward."""

    @staticmethod
    def forward(ctx, x, scatter_dim, gather_dim, group):
        ctx.dims, ctx.group = (scatter_dim, gather_dim), group
        return _all_to_all(x, scatter_dim, gather_dim, group)

    @staticmethod
    def backward(ctx, grad):
        scatter_dim, gather_dim = ctx.dims
        return _all_to_all(grad, gather_dim, scatter_dim, ctx.group), None, None, None


def all_to_all(x: torch.Tensor, scatter_dim: int, gather_dim: int, group: Any) -> torch.Tensor:
    """Differentiable all-to-all over `group` (see _all_to_all); `x`'s scatter_dim must divide by the group size."""
    return _AllToAll.apply(x, scatter_dim, gather_dim, group)


class _AllReduceSum(torch.autograd.Function):
    """Sum over `group` on every rank; its backward is the same sum of the gradients (every rank's loss reads it)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class CpSequenceSums(SequenceSums):
    """Per-sequence sums over a cp group's slices of one packed row (see the module docstring): each rank sums its own
    tokens into `n_seqs` slots (the micro-batch's sequence numbers, the same on every rank) and the group adds them.
    Every rank of the group calls the same methods in the same order (collectives), empty slices included."""

    def __init__(self, group: Any, n_seqs: int):
        self.group, self.n_seqs = group, max(n_seqs, 1)

    def slots(self, seq_index: torch.Tensor) -> int:
        return self.n_seqs

    def totals(self, values: torch.Tensor, seq_index: torch.Tensor) -> torch.Tensor:
        return _AllReduceSum.apply(self.own(values, seq_index), self.group)

    @torch.no_grad()
    def later(self, own: torch.Tensor) -> torch.Tensor:
        parts = [torch.empty_like(own) for _ in range(dist.get_world_size(self.group))]
        dist.all_gather(parts, own.contiguous(), group=self.group)
        after = parts[dist.get_rank(self.group) + 1:]
        return torch.stack(after).sum(0) if after else torch.zeros_like(own)


def ulysses_attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Any,
                      dropout: float = 0.0, scaling: float | None = None, is_causal: bool | None = None,
                      areal_segments: Any = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature. With a CpRow as `areal_segments` (a sharded micro-batch): query
    [1, H, L/cp, D], key/value [1, H_kv, L/cp, D] of this rank's tokens; returns [1, L/cp, H, D]. Anything else (an
    unsharded row, a padded batch, an idle rank's one-token forward) goes to varlen_attention as it is."""
    if not isinstance(areal_segments, CpRow):
        return varlen_attention(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                is_causal=is_causal, areal_segments=areal_segments, **kwargs)
    row = areal_segments
    cp = dist.get_world_size(row.group)
    if query.shape[1] % cp or key.shape[1] % cp:
        raise ConfigError(f"Ulysses context parallelism: cp {cp} must divide the layer's {query.shape[1]} query "
                          f"heads and {key.shape[1]} key/value heads (use_ulysses checks the model's config)")
    q, k, v = (all_to_all(t, 1, 2, row.group) for t in (query, key, value))  # [1, heads / cp, L', D]
    out, _ = varlen_attention(module, q, k, v, None, dropout=dropout, scaling=scaling, areal_segments=row.segments)
    return all_to_all(out, 1, 2, row.group), None  # [1, L', heads / cp, D] -> [1, L'/cp, heads, D]


def register() -> None:
    """Register ATTN in transformers' attention and mask interfaces (idempotent). The mask function is varlen's:
    no mask for a packed row, whose blocks travel as `areal_segments`."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTN, ulysses_attention)
    AttentionMaskInterface.register(ATTN, _mask)


def use_ulysses(model: Any, group: Any) -> Any:
    """Switch a Hugging Face model (or a PEFT model around one) to ATTN after checking that the cp group's size
    divides its head counts; returns it. A group of one rank leaves the model as it is."""
    cp = cp_size(group)
    if cp == 1:
        return model
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = base.config.get_text_config() if hasattr(base.config, "get_text_config") else base.config
    check_heads(config, cp)
    register()
    base.set_attn_implementation(ATTN)
    return model


class ContextParallel:
    """The trainer's one handle on Ulysses over its cp `group` (ParallelDims.cp_group; None at cp 1: every call a
    no-op, so the trainer calls them whatever the layout)."""

    def __init__(self, group: Any = None):
        self.group = group if group is not None and cp_size(group) > 1 else None

    def attach(self, model: Any) -> Any:
        """Switch `model` (policy or reference) to the Ulysses attention; after trainer.attention's setup."""
        return model if self.group is None else use_ulysses(model, self.group)

    def shard(self, mb: MicroBatch, pad_id: int = 0) -> MicroBatch:
        """This rank's share of a packed micro-batch (`mb` itself at cp 1)."""
        return mb if self.group is None else shard_microbatch(mb, self.group, pad_id)

    def sequence_sums(self, mb: MicroBatch) -> SequenceSums:
        """How ppo_loss sums a sequence of this (sharded) micro-batch: over the cp group, or LOCAL at cp 1."""
        return LOCAL if self.group is None else CpSequenceSums(self.group, len(mb.seq_ids))

    def reduce_grads(self, model: Any) -> None:
        """Sum the gradients over the cp ranks: once per mini-batch, after its backward, before clipping."""
        if self.group is not None:
            reduce_cp_grads(model, self.group)


@torch.no_grad()
def reduce_cp_grads(model: Any, group: Any) -> None:
    """Sum every parameter's gradient over the cp `group` (in place; a DTensor's local shard, whose cp peers hold
    the same shard). A no-op for a group of one rank. See the module docstring for when the trainer calls it."""
    if cp_size(group) == 1:
        return
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    works = [dist.all_reduce(g.to_local() if hasattr(g, "to_local") else g, group=group, async_op=True)
             for g in grads]
    for work in works:
        work.wait()
