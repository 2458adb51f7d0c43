"""Paged decode attention as one FlexAttention call per layer for all rows, reading K/V where they live in the pool.

What: `FlexDecode(block_size, pool_blocks, call)` (from `FlexKernels.for_pool`) turns a decode step's block tables [B, nb] and positions [B]
into a FlexAttention block mask (`mask(tables, positions)`, once per step) and attends each layer's queries over
that layer's pool seen as one long key axis (`attend(q, k_layer, v_layer, mask)`): K/V [1, KV, blocks * bs, hd], a
view, broadcast over the B query rows. Row b's block-mask row lists its own blocks (the table's first
`positions[b] // bs + 1` entries, physical block ids, the block size of the mask = the pool's): all but the last are
"full" blocks (no mask evaluated); the last is partial, its keys past `positions[b] % bs` masked. Nothing is gathered
or copied; the kernel walks each row's block list. Every input is a tensor and nothing syncs the host, so the call
captures in a CUDA graph (graphs.py) with the tables as data.

The call is `torch.compile`d (inductor: a C++ template on the CPU, Triton's flex-decoding kernel on CUDA), one
compiled kernel per pool size and padded row count: rows are padded to a power of two, at least MIN_ROWS (a padding
row lists no block and costs ~nothing), so an engine whose batch changes every step compiles at most
log2(max_concurrent / MIN_ROWS) + 1 kernels. Measured on the CPU: 6-15 s for a kernel (SmolLM2-135M shape, 2 cores,
inductor's on-disk cache cold for that shape); a later process finds it in the cache.

Why, and where it is the default (`EngineConfig.decode_attention: auto`): the plain path's gather (forward.py
`_gather`) copies B x context keys per layer; on a GPU that copy dominated the paged step (issue 51: 23.5 ms against
10.3 ms contiguous at 256 x 1,024), so `auto` takes this path on CUDA (not yet timed on a GPU: no GPU was lent).
On the CPU `auto` stays `plain`, by measurement (fp32, one thread, benchmarks/speed/RESULTS.md "FlexAttention
decode"): flex is faster where rows are ragged or in several runs (the quickstart's 16 rows of 150-260 keys 1.24x,
the 32-row long tail 1.45x; the quickstart's held-out evaluation, paged_vs_contiguous_eval 1.87 with flex against
1.51 measured with plain on another day) but slower where plain's in-place views batch every row in one call (16
rows x 300 keys 0.89x, x 1,024 keys 0.82x), and it compiles in every new process (above) and needs a C++ compiler.
Set `decode_attention: flex` for evaluation-sized batches. The plain path stays the reference everywhere: tests check
this one against it and against HF (tests/unit/engines/test_torch_flex.py, test_torch_golden.py).

How to run: `rollout.engine.decode_attention: flex` (or `auto` on CUDA); speed in
`python benchmarks/speed/engine.py --decode --attention flex --dtype float32`.
"""
from __future__ import annotations

from typing import Callable

import torch

MIN_ROWS = 8  # rows are padded to a power of two, at least this: fewer kernels to compile; a padding row costs ~0


def padded_rows(n: int) -> int:
    """Query rows of a compiled call for n rows: the next power of two, at least MIN_ROWS."""
    return max(MIN_ROWS, 1 << max(n - 1, 0).bit_length())


class FlexMask:
    """One decode step's block mask inputs (tensors on the pool's device), padded to a power-of-two row count."""

    def __init__(self, rows: int, kv_num: torch.Tensor, kv_idx: torch.Tensor, full_num: torch.Tensor,
                 full_idx: torch.Tensor, last_block: torch.Tensor, last_off: torch.Tensor):
        self.rows = rows  # real rows (the rest is padding)
        self.kv_num, self.kv_idx, self.full_num, self.full_idx = kv_num, kv_idx, full_num, full_idx
        self.last_block, self.last_off = last_block, last_off

    @property
    def padded_rows(self) -> int:
        return self.kv_num.shape[0]


def _flex_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_num: torch.Tensor, kv_idx: torch.Tensor,
                 full_num: torch.Tensor, full_idx: torch.Tensor, last_block: torch.Tensor, last_off: torch.Tensor,
                 block_size: int) -> torch.Tensor:
    """q [B, KV, G, hd] (each KV head's query group on the query axis), k/v [1, KV, blocks * bs, hd]
    -> [B, KV, G, hd] (module docstring)."""
    from torch.nn.attention.flex_attention import BlockMask, flex_attention

    def mask_mod(b, h, q_idx, kv_idx_):  # only the partial (last) block of a row runs it
        return ((kv_idx_ // block_size) != last_block[b]) | ((kv_idx_ % block_size) <= last_off[b])

    mask = BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=(q.shape[2], block_size),
                                    mask_mod=mask_mod, seq_lengths=(q.shape[2], k.shape[2]), compute_q_blocks=False)
    return flex_attention(q, k, v, block_mask=mask)


class FlexDecode:
    """Block masks from block tables and the compiled per-layer attention call (module docstring)."""

    def __init__(self, block_size: int, pool_blocks: int, call: Callable[..., torch.Tensor]):
        self.block_size, self.pool_blocks = block_size, pool_blocks  # pool_blocks: with the scratch block
        self._call = call

    def mask(self, tables: torch.Tensor, positions: torch.Tensor) -> FlexMask:
        """Block mask inputs of rows with block tables [B, nb] (padding: any valid block) at positions [B]; rows are
        padded to a power of two (a padding row lists no block). Tensor ops only: no host sync."""
        b, nb = tables.shape
        bp, device = padded_rows(b), tables.device
        used = torch.div(positions, self.block_size, rounding_mode="floor") + 1  # blocks row b reads
        idx = torch.zeros(bp, self.pool_blocks, dtype=torch.int32, device=device)
        idx[:b, :nb] = tables.to(torch.int32)
        last_block = torch.zeros(bp, dtype=torch.int32, device=device)
        last_block[:b] = tables.gather(1, (used - 1).unsqueeze(1)).squeeze(1).to(torch.int32)
        last_off = torch.zeros(bp, dtype=torch.int32, device=device)
        last_off[:b] = (positions % self.block_size).to(torch.int32)
        kv_num = torch.zeros(bp, dtype=torch.int32, device=device)
        kv_num[:b] = 1  # the partial block
        full_num = torch.zeros(bp, dtype=torch.int32, device=device)
        full_num[:b] = (used - 1).to(torch.int32)
        part_idx = torch.zeros(bp, self.pool_blocks, dtype=torch.int32, device=device)
        part_idx[:, 0] = last_block
        view = (bp, 1, 1)
        return FlexMask(b, kv_num.view(view), part_idx.view(*view, -1), full_num.view(view), idx.view(*view, -1),
                        last_block, last_off)

    def attend(self, q: torch.Tensor, k_layer: torch.Tensor, v_layer: torch.Tensor, mask: FlexMask) -> torch.Tensor:
        """q [B, H, 1, hd] over one layer's pool k/v [KV, blocks, bs, hd] -> [B, H, 1, hd]. Each KV head's G query
        heads go on the query axis (q [B, KV, G, hd]), so a block of keys is read once for its group, not once per
        query head as with enable_gqa."""
        kv, blocks, bs, hd = k_layer.shape
        b, h = q.shape[0], q.shape[1]
        q = q.reshape(b, kv, h // kv, hd)
        if mask.padded_rows != b:
            q = torch.cat([q, q.new_zeros(mask.padded_rows - b, *q.shape[1:])])
        out = self._call(q, k_layer.view(1, kv, blocks * bs, hd), v_layer.view(1, kv, blocks * bs, hd),
                         mask.kv_num, mask.kv_idx, mask.full_num, mask.full_idx, mask.last_block, mask.last_off, bs)
        return out[:b].reshape(b, h, 1, hd)


class FlexKernels:
    """The compiled attention call, shared by every pool of a runner; `for_pool` gives a pool's FlexDecode.
    compiled=False runs FlexAttention eagerly (a slow dense reference of the same masks, for tests)."""

    def __init__(self, compiled: bool = True):
        self.call = torch.compile(_flex_decode, dynamic=False, fullgraph=True) if compiled else _flex_decode
        self._pools: dict[tuple[int, int], FlexDecode] = {}

    def for_pool(self, block_size: int, pool_blocks: int) -> FlexDecode:
        key = (block_size, pool_blocks)
        if key not in self._pools:
            self._pools[key] = FlexDecode(block_size, pool_blocks, self.call)
        return self._pools[key]
