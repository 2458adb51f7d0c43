"""Sequences -> micro-batches: dynamic padding-free packing (default) or fixed-size padded batches.

What:
- `samples_to_seqs` flattens Sample groups into `SeqData` (prompt + generated tokens, behaviour
  logprobs, versions, the sequence's advantage).
- `plan_step` splits a step's sequences into PPO mini-batches, each mini-batch across data-parallel
  ranks (longest-processing-time first: balanced token counts), and each rank's share into
  micro-batches: first-fit-decreasing bins under `max_tokens_per_mb` ("dynamic"), or
  `padded_mb_size` sequences in arrival order ("padded", the baseline). Every rank computes the
  same plan from the same sequence list, so no communication is needed.
- "shared" (the default) packs like "dynamic" but puts the sequences of one group — n samples of ONE
  prompt — into a bin as a unit laid out [prompt, completion 1, ..., completion n]: the prompt is
  computed once, each completion continues at positions P.. and attends to the prompt and to itself
  (a tree-shaped 4D mask, see `build_microbatch`). With GRPO groups and few-shot prompts the prompt is
  most of the tokens (quickstart: 151 prompt tokens, ~30 generated), so this computes ~2.5x fewer
  tokens; the loss and gradients are those of separate sequences (tests/unit/algorithms/test_packing.py).
- `build_microbatch` turns one bin into tensors. Packed: ONE row, sequences concatenated, position
  ids restarting at 0 per sequence and no attention mask — transformers (>= 4.53, checked on 5.23)
  then builds a block-diagonal causal mask from the position ids, so attention never crosses
  sequences. Forward MUST pass use_cache=False: with a cache the packed-sequence detection is skipped.
  A sequence longer than the budget gets a micro-batch of its own (counted as oversized). The budget
  bounds the row, and on CPU attention over a masked row costs O(row^2): see `max_tokens_per_mb`.
  Every tensor of a micro-batch is made on `device` (the trainer's: its index arrays are copied over once,
  and the shared-prompt mask is computed there from two [L] vectors instead of copied as an L x L matrix).
- Multi-turn episodes (areal_mq/workflows) are ONE sequence each: [first prompt, turn 1, feedback, turn 2, ...]
  with `loss_mask` over everything after the prompt. Environment tokens (mask 0) are fed to the model as
  context but are no training targets: the per-token tensors (targets, logprobs, advantages, versions) hold
  the generated tokens only, and the loss normalises by their count.
Why: on long-tail length mixes padding wastes most of the compute; packing removes it while the
loss and gradients stay exactly those of the unpacked computation (tests/unit/algorithms).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Sequence

import numpy as np

from areal_mq.algorithms.advantages import step_advantages
from areal_mq.algorithms.config import TrainerConfig

if TYPE_CHECKING:
    import torch

    from areal_mq.messages import Sample


@dataclass
class SeqData:
    """One training sequence. tokens  # [P+T] int64; behav_logp, versions  # [T];
    loss_mask  # [T] or None (all T trained): which of the T tokens after the prompt are trained."""

    tokens: np.ndarray
    prompt_len: int
    behav_logp: np.ndarray
    versions: np.ndarray
    advantage: float
    sample_id: str
    loss_mask: np.ndarray | None = None

    @property
    def train_idx(self) -> np.ndarray:
        """Positions (0-based, after the prompt) of the tokens the loss trains on."""
        if self.loss_mask is None:
            return np.arange(self.n_gen)
        return np.flatnonzero(self.loss_mask)

    @property
    def n_train(self) -> int:
        return self.n_gen if self.loss_mask is None else int(np.count_nonzero(self.loss_mask))

    @property
    def length(self) -> int:
        return len(self.tokens)

    @property
    def n_gen(self) -> int:
        return len(self.tokens) - self.prompt_len


def trains_anything(samples: Sequence["Sample"]) -> bool:
    """Whether `samples` hold a token to train on: a sequence with a generated token, a trained loss-mask entry
    and not loss_excluded (controller.overlong_filter). False: the step has no loss at all."""
    return any(len(seq.output_ids) and not seq.loss_excluded and (seq.loss_mask is None or seq.loss_mask.any())
               for sample in samples for seq in sample.seqs)


def samples_to_seqs(samples: Sequence["Sample"], cfg: TrainerConfig) -> list[SeqData]:
    """Flatten groups into sequences with their advantages. Sequences with no generated token are
    dropped (nothing to train on), and so are loss_excluded ones (DAPO overlong filtering) after the advantages
    are computed over the whole group, theirs included; an empty prompt is refused (its first token has no
    context)."""
    seqs: list[SeqData] = []
    groups = step_advantages([np.array([s.reward for s in sample.seqs]) for sample in samples], cfg)
    for sample, advs in zip(samples, groups):
        for i, (seq, adv) in enumerate(zip(sample.seqs, advs)):
            if len(seq.prompt_ids) == 0:
                raise ValueError(
                    f"sample {sample.sample_id!r} sequence {i} has an empty prompt: its first generated token "
                    "has no context to score it; the controller must send at least one prompt token"
                )
            mask = None if seq.loss_mask is None else np.asarray(seq.loss_mask, np.uint8)
            if len(seq.output_ids) == 0 or seq.loss_excluded or (mask is not None and not mask.any()):
                continue
            tokens = np.concatenate([seq.prompt_ids, seq.output_ids]).astype(np.int64)
            seqs.append(SeqData(tokens, len(seq.prompt_ids), np.asarray(seq.logprobs, np.float32),
                                np.asarray(seq.versions, np.int64), float(adv), sample.sample_id, mask))
    return seqs


# ---------------------------------------------------------------- planning (pure index arithmetic)
def lpt_partition(indices: Sequence[int], weights: Sequence[int], k: int) -> list[list[int]]:
    """Split `indices` into k parts of balanced total weight (heaviest first to the lightest part).
    Deterministic: ties go to the lowest part index; each part keeps ascending index order."""
    parts: list[list[int]] = [[] for _ in range(k)]
    loads = [0] * k
    for i in sorted(indices, key=lambda j: (-weights[j], j)):
        target = min(range(k), key=lambda p: (loads[p], p))
        parts[target].append(i)
        loads[target] += weights[i]
    return [sorted(p) for p in parts]


def ffd_bins(indices: Sequence[int], lengths: Sequence[int], budget: int) -> list[list[int]]:
    """First-fit-decreasing bin packing under `budget` tokens; an oversized item gets its own bin."""
    bins: list[list[int]] = []
    loads: list[int] = []
    for i in sorted(indices, key=lambda j: (-lengths[j], j)):
        for b, load in enumerate(loads):
            if load + lengths[i] <= budget:
                bins[b].append(i)
                loads[b] += lengths[i]
                break
        else:
            bins.append([i])
            loads.append(lengths[i])
    return bins


def prompt_units(seqs: Sequence[SeqData], ids: Sequence[int]) -> list[list[int]]:
    """`ids` grouped by identical prompt (same sample and same prompt tokens), in first-appearance order."""
    units: dict[tuple, list[int]] = {}
    for i in ids:
        s = seqs[i]
        units.setdefault((s.sample_id, s.prompt_len, s.tokens[:s.prompt_len].tobytes()), []).append(i)
    return list(units.values())


def shared_bins(seqs: Sequence[SeqData], ids: Sequence[int], budget: int) -> list[list[int]]:
    """First-fit-decreasing over prompt units (prompt once + its completions); a unit over the budget is
    split into several, each with its own copy of the prompt."""
    units: list[list[int]] = []
    for unit in prompt_units(seqs, ids):
        prompt, part, load = seqs[unit[0]].prompt_len, [], 0
        for i in unit:
            if part and load + seqs[i].n_gen > budget:
                units.append(part)
                part, load = [], 0
            part.append(i)
            load = (load or prompt) + seqs[i].n_gen
        units.append(part)
    sizes = [seqs[u[0]].prompt_len + sum(seqs[i].n_gen for i in u) for u in units]
    return [[i for u in b for i in units[u]] for b in ffd_bins(range(len(units)), sizes, budget)]


@dataclass
class StepPlan:
    """Micro-batch bins (sequence indices) of this rank, per mini-batch, and the global counts the
    loss normalises by (generated tokens and sequences of each whole mini-batch, over all ranks)."""

    minibatches: list[list[list[int]]]
    gen_tokens: list[int]
    oversized: int = 0
    all_minibatch_seqs: list[list[int]] = field(default_factory=list)
    n_seqs: list[int] = field(default_factory=list)  # sequences of each whole mini-batch, over all ranks


def plan_step(seqs: Sequence[SeqData], cfg: TrainerConfig, world_size: int = 1, rank: int = 0) -> StepPlan:
    """Mini-batches -> ranks -> micro-batches, identical on every rank."""
    lengths = [s.length for s in seqs]
    n_mb = min(cfg.ppo_n_minibatches, len(seqs)) or 1
    minis = lpt_partition(range(len(seqs)), lengths, n_mb)
    plan = StepPlan([], [], 0, minis)
    for mini in minis:
        mine = lpt_partition(mini, lengths, world_size)[rank]
        if cfg.packing == "shared":
            bins = shared_bins(seqs, mine, cfg.max_tokens_per_mb)
        elif cfg.packing == "dynamic":
            bins = ffd_bins(mine, lengths, cfg.max_tokens_per_mb)
        else:
            bins = [mine[i:i + cfg.padded_mb_size] for i in range(0, len(mine), cfg.padded_mb_size)]
        plan.minibatches.append(bins)
        plan.gen_tokens.append(sum(seqs[i].n_train for i in mini))
        plan.n_seqs.append(len(mini))
        plan.oversized += sum(1 for i in mine if lengths[i] > cfg.max_tokens_per_mb)
    return plan


# ---------------------------------------------------------------- tensors
@dataclass
class MicroBatch:
    """Model inputs of one micro-batch plus per-generated-token training data ([N] tensors).

    input_ids, position_ids  # [B, L] (B == 1 when packed); attention_mask  # [B, L] or None (packed)
    keep_cols  # [C] sequence columns whose logits are needed (passed as logits_to_keep)
    logit_index  # [N] index into the flattened [B*C] kept logits predicting each generated token
    """

    seq_ids: list[int]
    input_ids: "torch.Tensor"
    position_ids: "torch.Tensor"
    attention_mask: "torch.Tensor | None"
    keep_cols: "torch.Tensor"
    logit_index: "torch.Tensor"
    targets: "torch.Tensor"
    behav_logp: "torch.Tensor"
    advantages: "torch.Tensor"
    versions: "torch.Tensor"
    seq_index: "torch.Tensor"  # [N] which of the micro-batch's sequences (0..S-1, in order) each token is from
    n_tokens: int  # real (non-pad) tokens fed to the model
    prox_logp: "torch.Tensor | None" = None
    ref_logp: "torch.Tensor | None" = None
    # trainer.attention varlen, packed rows only: per prompt unit (prompt start, prompt end, [(start, end) of each
    # completion]) in columns; the row attends block by block through these instead of a mask (attention.py)
    segments: list | None = None


def build_microbatch(seqs: Sequence[SeqData], ids: Sequence[int], packed: bool, pad_id: int = 0,
                     share_prompts: bool = False, device: "torch.device | str | None" = None,
                     varlen: bool = False) -> MicroBatch:
    """Tensors for the sequences `ids` on `device` (default cpu), packed into one row or right-padded rows;
    with `share_prompts` one row where each prompt appears once (see the module docstring). `varlen`
    (trainer.attention varlen): a packed row carries its blocks (`segments`) and no mask (algorithms/attention.py)."""
    import torch

    if packed and share_prompts:
        return _shared_microbatch(seqs, ids, device, varlen)
    put = _to_device(device)
    chosen = [seqs[i] for i in ids]
    if packed:
        rows = [np.concatenate([s.tokens for s in chosen])]
        pos = [np.concatenate([np.arange(s.length) for s in chosen])]
        starts = np.cumsum([0] + [s.length for s in chosen[:-1]])
        where = [(0, int(o)) for o in starts]
        width = len(rows[0])
    else:
        width = max(s.length for s in chosen)
        rows = [np.pad(s.tokens, (0, width - s.length), constant_values=pad_id) for s in chosen]
        pos = [np.arange(width) for _ in chosen]
        where = [(r, 0) for r in range(len(chosen))]
    row_idx, col_idx = [], []
    for (r, off), s in zip(where, chosen):
        cols = off + s.prompt_len - 1 + s.train_idx  # logits at column c score the token at c+1
        row_idx.append(np.full(len(cols), r))
        col_idx.append(cols)
    rows_np, cols_np = np.concatenate(row_idx), np.concatenate(col_idx)
    keep = np.unique(cols_np)
    logit_index = rows_np * len(keep) + np.searchsorted(keep, cols_np)
    mask = None
    if not packed:
        mask = put(np.stack([np.arange(width) < s.length for s in chosen]), torch.long)
    segments = [(off, off + s.length, []) for (_, off), s in zip(where, chosen)] if packed and varlen else None
    return MicroBatch(
        segments=segments,
        seq_ids=list(ids),
        input_ids=put(np.stack(rows), torch.long),
        position_ids=put(np.stack(pos), torch.long),
        attention_mask=mask,
        keep_cols=put(keep, torch.long),
        logit_index=put(logit_index, torch.long),
        **_trained(chosen, put),
        n_tokens=sum(s.length for s in chosen),
    )


def _to_device(device: "torch.device | str | None"):
    """`put(array, dtype)`: a numpy array as a tensor of `dtype` on `device` (one copy; none on the CPU)."""
    import torch

    return lambda array, dtype: torch.as_tensor(np.ascontiguousarray(array)).to(device=device, dtype=dtype)


def _shared_microbatch(seqs: Sequence[SeqData], ids: Sequence[int], device: "torch.device | str | None",
                       varlen: bool = False) -> MicroBatch:
    """One row [prompt_a, completions of a..., prompt_b, ...] with a boolean [1, 1, L, L] mask (True =
    attend): a prompt attends causally to itself; a completion to its prompt and causally to itself. The
    first generated token is scored by the prompt's last column, which the completions of a unit share.
    The mask is computed on `device` from each column's block (a prompt or a completion) and the block it
    also sees (a completion: its prompt; a prompt: itself): attend[i, j] = j <= i and block[j] in
    {block[i], parent[i]} (a prompt comes before its completions, so j <= i holds for all of it). `varlen`: no mask;
    the blocks' columns as `segments` instead (algorithms/attention.py)."""
    import torch

    put = _to_device(device)
    order: list[int] = []
    toks, pos, cols, block, parent = [], [], [], [], []
    segments: list = []
    off = 0
    for unit in prompt_units(seqs, ids):
        p_len = seqs[unit[0]].prompt_len
        p0, prompt_block = off, len(block)
        segments.append((p0, p0 + p_len, []))
        toks.append(seqs[unit[0]].tokens[:p_len])
        pos.append(np.arange(p_len))
        block.append(np.full(p_len, prompt_block))
        parent.append(np.full(p_len, prompt_block))
        off += p_len
        for i in unit:
            gen = seqs[i].tokens[p_len:]
            toks.append(gen)
            pos.append(p_len + np.arange(len(gen)))
            cols.append(np.concatenate([[p0 + p_len - 1], off + np.arange(len(gen) - 1)])[seqs[i].train_idx]
                        .astype(np.int64))
            block.append(np.full(len(gen), len(block)))
            parent.append(np.full(len(gen), prompt_block))
            segments[-1][2].append((off, off + len(gen)))
            order.append(i)
            off += len(gen)
    mask = None
    if not varlen:
        block_t, parent_t = put(np.concatenate(block), torch.long), put(np.concatenate(parent), torch.long)
        causal = torch.ones(off, off, dtype=torch.bool, device=block_t.device).tril_()
        mask = (causal & ((block_t[None, :] == block_t[:, None]) | (block_t[None, :] == parent_t[:, None])))[None, None]
    cols_np = np.concatenate(cols)
    keep = np.unique(cols_np)
    chosen = [seqs[i] for i in order]
    return MicroBatch(
        seq_ids=order,
        input_ids=put(np.concatenate(toks)[None], torch.long),
        position_ids=put(np.concatenate(pos)[None], torch.long),
        attention_mask=mask,
        keep_cols=put(keep, torch.long),
        logit_index=put(np.searchsorted(keep, cols_np), torch.long),
        **_trained(chosen, put),
        n_tokens=off,
        segments=segments if varlen else None,
    )


def _trained(chosen: Sequence[SeqData], put) -> dict:
    """The per-token tensors of the trained tokens of `chosen`, in order (targets, behaviour logprobs,
    advantages, versions, the index of the token's sequence in `chosen`), made by `put` on the micro-batch's
    device; environment tokens of episodes (loss_mask 0) are left out."""
    import torch

    idx = [s.train_idx for s in chosen]
    cat = np.concatenate
    return {
        "targets": put(cat([s.tokens[s.prompt_len:][i] for s, i in zip(chosen, idx)]), torch.long),
        "behav_logp": put(cat([s.behav_logp[i] for s, i in zip(chosen, idx)]), torch.float32),
        "advantages": put(cat([np.full(len(i), s.advantage) for s, i in zip(chosen, idx)]), torch.float32),
        "versions": put(cat([s.versions[i] for s, i in zip(chosen, idx)]), torch.long),
        "seq_index": put(np.repeat(np.arange(len(chosen)), [len(i) for i in idx]), torch.long),
    }
