"""CPU decode attention read in place from the paged KV pool: no gather copy (issue 42, "stays at least as fast").

What: a row's keys are its block table's first `keys` positions. Where the table is a few runs of consecutive blocks
(kvcache.py places blocks so that most tables are: a shared prompt run, then the sample's own), each run is one
strided view of the pool [KV, keys, hd], no copy. Rows whose runs have the same key counts and whose run starts
step by the same number of blocks from row to row (rows admitted together with the same max_new_tokens, the samples
of a group on their one shared prompt run: a step of 0) are one batch: one `as_strided` view per run over all of
them, one attention call per run for the whole batch.

- `runs_of(table, keys, block_size)`: (first block, blocks, keys) per run.
- `plan(rows, block_size)`: rows (index, runs) -> batches (row indices, [(first block, block step between rows,
  keys)] per run, the last run's keys per row when they differ: that run is then read whole and masked).
- `batch_views(k_pool, v_pool, spec, rows)`: views [layers, rows, KV, keys, hd] per run, made once per step.
- `attend(q, views, layer)`: the batch's attention output [rows, KV, G, hd].

Why: on the CPU, gathering each row's blocks into a contiguous tensor costs more than the attention itself (a
16 x 1,024-key fp32 batch: 2.7 ms of copies per layer beside 2.1 ms of attention), and SDPA reads strided keys as
fast as contiguous ones. The attention kernel is the one SDPA picks on the CPU (flash attention for the CPU), called
directly: it returns the log-sum-exp that merges several runs exactly, and skips SDPA's dispatch (~20 us a call).
On CUDA the decode gathers (graphs.py captures that step; a per-run launch would cost more than the copy there).

How to run: used by forward.py `LlamaRunner.decode`; tests in tests/unit/engines/test_torch_inplace.py; speed in
`python benchmarks/speed/engine.py --decode`.
"""
from __future__ import annotations

from typing import Sequence

import torch

from areal_mq.engines.torch.kvcache import blocks_for

MAX_RUNS = 4  # a row in more runs of consecutive blocks than this is gathered instead (fragmented: a copy is cheaper)
# a batch of rows in several runs is read in place only when it has at least this many rows: each run is a kernel
# call and the merge a few more small ops per layer, which for a row or two cost more than gathering them
MIN_MULTI_RUN_ROWS = 4
_cpu_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu  # (q, k, v) -> (out, log-sum-exp, ...)

Run = tuple[int, int, int]


def runs_of(table: Sequence[int], keys: int, block_size: int) -> list[Run]:
    """The first `keys` positions of a block table as runs of consecutive blocks: (first block, blocks, keys)."""
    spans: list[list[int]] = []
    for b in table[: blocks_for(keys, block_size)]:
        if spans and spans[-1][0] + spans[-1][1] == b:
            spans[-1][1] += 1
        else:
            spans.append([b, 1])
    out, left = [], keys
    for first, n in spans:
        take = min(left, n * block_size)
        out.append((first, n, take))
        left -= take
    return out


def plan(rows: Sequence[tuple[int, list[Run]]], block_size: int
         ) -> list[tuple[list[int], list[Run], list[int] | None]]:
    """Batches of rows read by one view per run: (row indices, [(first block of the batch's first row, block step
    from row to row, keys)] per run, the last run's keys per row or None). Rows join a batch when their runs have the
    batch's block counts and every run's start is the previous row's plus the batch's (non-negative) step. Rows whose
    key counts differ (only in the last run, then) read that run's whole blocks, the keys past each row's own masked
    (those positions are in blocks the row holds: finite, zeroed when first handed out or written before)."""
    by_shape: dict[tuple[int, ...], list[tuple[int, list[Run]]]] = {}
    for index, runs in rows:
        by_shape.setdefault(tuple(n for _, n, _ in runs), []).append((index, runs))
    batches = []
    for members in by_shape.values():
        members.sort(key=lambda m: [first for first, _, _ in m[1]])
        batch, steps = [members[0]], None
        for member in members[1:]:
            step = [f - g for (f, _, _), (g, _, _) in zip(member[1], batch[-1][1])]
            if min(step) >= 0 and steps in (None, step):
                batch.append(member)
                steps = step
                continue
            batches.append(_spec(batch, steps, block_size))
            batch, steps = [member], None
        batches.append(_spec(batch, steps, block_size))
    return [b for b in batches if len(b[1]) == 1 or len(b[0]) >= MIN_MULTI_RUN_ROWS]


def _spec(batch: list[tuple[int, list[Run]]], steps: list[int] | None, block_size: int
          ) -> tuple[list[int], list[Run], list[int] | None]:
    first_runs = batch[0][1]
    last_keys = [runs[-1][2] for _, runs in batch]
    ragged = len(set(last_keys)) > 1
    spec = [(f, steps[j] if steps else 0, n * block_size if ragged and j == len(first_runs) - 1 else k)
            for j, (f, n, k) in enumerate(first_runs)]
    return [i for i, _ in batch], spec, last_keys if ragged else None


def batch_views(k_pool: torch.Tensor, v_pool: torch.Tensor, spec: Sequence[Run],
                rows: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per run of `spec` (first block, step, keys), strided views [layers, rows, KV, keys, hd] of the pools
    [layers, KV, blocks, block_size, hd] (contiguous: the keys of consecutive blocks are one stride apart)."""
    layers, kv, _, bs, hd = k_pool.shape
    s_layer, s_head, s_block = k_pool.stride()[:3]
    out = []
    for first, step, keys in spec:
        size, stride = (layers, rows, kv, keys, hd), (s_layer, step * s_block, s_head, hd, 1)
        out.append(tuple(pool.as_strided(size, stride, pool.storage_offset() + first * s_block)
                         for pool in (k_pool, v_pool)))
    return out


def last_run_mask(last_keys: Sequence[int], keys: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Additive mask [rows, 1, 1, keys] of a ragged batch's last run: 0 for a row's own keys, -inf past them."""
    valid = torch.arange(keys, device=device) < torch.tensor(list(last_keys), device=device).unsqueeze(1)
    mask = torch.zeros(valid.shape, dtype=dtype, device=device).masked_fill_(~valid, float("-inf"))
    return mask.view(len(last_keys), 1, 1, keys)


def attend(q: torch.Tensor, views: Sequence[tuple[torch.Tensor, torch.Tensor]], layer: int,
           mask: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of q [rows, KV, G, hd] over the batch's run views in `layer` (`mask`: the last run's, ragged
    batches): one kernel call per run; several runs are merged by their log-sum-exps (the softmax over all of a
    row's keys, in float32 as the kernel computes it)."""
    last = len(views) - 1
    if last == 0:
        return _cpu_flash(q, views[0][0][layer], views[0][1][layer], attn_mask=mask)[0]
    outs, lses = [], []
    for j, (k, v) in enumerate(views):
        out, lse = _cpu_flash(q, k[layer], v[layer], attn_mask=mask if j == last else None)[:2]
        outs.append(out)
        lses.append(lse)
    weights = torch.softmax(torch.stack(lses), 0).unsqueeze(-1)  # [runs, rows, KV, G, 1]: exp(lse_run - lse_all)
    return (torch.stack(outs).float() * weights).sum(0).to(q.dtype)
