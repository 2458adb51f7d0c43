"""The torch engine's paged KV cache: one pool of fixed-size blocks, a block table per sequence.

What: `PagedKVCache` holds k / v as [layers, kv_heads, blocks + 1, block_size, head_dim] on the engine's device,
allocated once (never moved: a captured CUDA graph keeps its address). A sequence owns a block table, the list of
block ids holding its positions in order: position p lives in block table[p // block_size] at offset
p % block_size. Blocks are taken as tokens are produced (`ensure`) and returned when a sequence leaves
(`release`), so a short answer holds a few blocks and a 2,048-token one holds what it wrote, never a
`max_model_len` slot. Block `scratch` (the last) belongs to no sequence: padding rows of a bucketed decode step
write there, and block tables are padded with it (its keys are masked).

Sharing: every block has a reference count. The n samples of one prompt point at the same prompt blocks
(`share`); a write into a block another sequence also references first copies it (`writable`: copy-on-write,
which in practice is the partial last prompt block, copied once per sample at its first decoded token).

Placement (runs): a table grows into the block right after its last one when that block is free, and starts a new
run elsewhere only when it is not. A new run goes to the lowest free gap with room for `hint` blocks (the most the
sequence will hold: the engine passes prompt + max_new_tokens) after the room the run ending just before the gap
claimed for itself, so concurrent sequences grow side by side without interleaving their blocks; when no gap has
that room, the gap with the most, else the middle of the largest gap. Most tables are then one or two runs of
consecutive blocks (a shared prompt run, then the sample's own), which the CPU decode reads in place, as strided
views, with no gather copy (forward.py `decode`). Placement is bookkeeping only: any table is valid, a fragmented
one is just read through the gather path.

Memory: the pool is sized by `pool_blocks` from `kv_cache_bytes`, else a fraction of free CUDA memory, else (CPU)
`max_kv_tokens` positions. On the CPU the pool is `torch.empty`: pages the OS never saw cost nothing until a block
is first handed out (it is zeroed then; masked keys still meet V in the softmax product, and garbage may be NaN),
so resident memory follows the blocks ever handed out, wherever runs put them.

Why KV heads before blocks: attention gathers a row's blocks with one `index_select` over (head, block) pairs
(`gather_index`) and the result is already [rows, kv_heads, keys, head_dim] with each head's keys contiguous, the
layout SDPA reads fastest; measured on the CPU, 1.4x faster than blocks-first plus a transposed view.
"""
from __future__ import annotations

import re
from typing import Sequence

import torch

from areal_mq.errors import ConfigError


def bytes_per_token(layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """K and V of one token over all layers."""
    return 2 * layers * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


def blocks_for(tokens: int, block_size: int) -> int:
    """Blocks that hold `tokens` positions."""
    return -(-tokens // block_size)


def pool_blocks(budget_bytes: int, per_token: int, block_size: int, min_blocks: int) -> int:
    """Usable blocks a pool of `budget_bytes` holds (one more, the scratch block, is inside the budget);
    ConfigError when that is under `min_blocks`."""
    usable = budget_bytes // (block_size * per_token) - 1
    if usable < min_blocks:
        raise ConfigError(
            f"kv_cache_bytes={budget_bytes} holds {max(usable, 0)} KV blocks of {block_size} tokens "
            f"({per_token} bytes per token) plus the scratch block; raise kv_cache_bytes to at least "
            f"{(min_blocks + 1) * block_size * per_token} (one block per concurrent sequence) or lower max_concurrent")
    return usable


class PagedKVCache:
    """A block pool with reference counts (module docstring). Host bookkeeping only; no method syncs the device."""

    def __init__(self, layers: int, num_blocks: int, block_size: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu"):
        self.num_blocks, self.block_size, self.scratch = num_blocks, block_size, num_blocks
        shape = (layers, kv_heads, num_blocks + 1, block_size, head_dim)
        self.k = torch.empty(shape, dtype=dtype, device=device)
        self.v = torch.empty(shape, dtype=dtype, device=device)
        self._zero([self.scratch])
        self.refs = [0] * num_blocks
        self.free_map = bytearray(b"\x01") * num_blocks  # 1 where a block is free
        self.free_blocks = num_blocks
        self.touched = bytearray(num_blocks)  # 1 once a block was handed out (zeroed then)
        self.claims: dict[int, int] = {}  # last block of a run -> end of the room that run claimed to grow into
        self.peak_used = 0
        self.copies = 0  # copy-on-write block copies

    @property
    def device(self) -> torch.device:
        return self.k.device

    @property
    def static(self) -> bool:  # allocated once, never moved (graphs.py relies on it)
        return True

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def used(self) -> int:
        return self.num_blocks - self.free_blocks

    @property
    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2

    def _zero(self, blocks: list[int]) -> None:
        with torch.inference_mode():
            index = torch.tensor(blocks, dtype=torch.long, device=self.device)
            self.k.index_fill_(2, index, 0)
            self.v.index_fill_(2, index, 0)

    def _run_start(self, want: int) -> int:
        """Where a new run of up to `want` blocks starts (module docstring, Placement); the pool has a free block."""
        best, best_room, largest = -1, 0, (0, 0)
        for gap in re.finditer(rb"\x01+", self.free_map):
            s, e = gap.span()
            start = min(max(s, self.claims.get(s - 1, s)), e)
            if e - start >= want:
                return start
            if e - start > best_room:
                best, best_room = start, e - start
            if e - s > largest[1] - largest[0]:
                largest = (s, e)
        if best >= 0:
            return best
        s, e = largest
        return s if s == 0 else s + (e - s) // 2

    def _take(self, n: int, after: int | None = None, hint: int = 0) -> list[int]:
        """n free blocks: consecutive after block `after` while those are free, new runs (`_run_start`) otherwise."""
        blocks, claim = [], self.claims.pop(after, 0) if after is not None else 0
        for i in range(n):
            b = after + 1 if after is not None and after + 1 < self.num_blocks and self.free_map[after + 1] else -1
            if b < 0:
                want = max(hint - i, n - i)
                b = self._run_start(want)
                claim = b + want
            self.free_map[b] = 0
            blocks.append(b)
            after = b
        self.claims[after] = claim
        new = [b for b in blocks if not self.touched[b]]
        if new:
            self._zero(new)
            for b in new:
                self.touched[b] = 1
        for b in blocks:
            self.refs[b] = 1
        self.free_blocks -= n
        self.peak_used = max(self.peak_used, self.used)
        return blocks

    def ensure(self, table: list[int], length: int, hint: int = 0) -> bool:
        """Grow `table` (in place) to hold `length` positions; False (table unchanged) when the pool is short.
        hint: the most blocks this table will hold (placement of a new run; 0: only what it needs now)."""
        need = blocks_for(length, self.block_size) - len(table)
        if need <= 0:
            return True
        if need > self.free_blocks:
            return False
        after = table[-1] if table and self.refs[table[-1]] == 1 else None  # never grow into a shared run's room
        table.extend(self._take(need, after, hint - len(table)))
        return True

    def writable(self, table: list[int], start: int, end: int, hint: int = 0) -> bool:
        """Make the blocks holding positions [start, end) of `table` this sequence's own, copying any block that is
        shared (copy-on-write); False when the pool has no block for a copy (the table is then unchanged from the
        first block it could not copy). hint as in `ensure`."""
        bs = self.block_size
        for i in range(start // bs, min(blocks_for(end, bs), len(table))):
            old = table[i]
            if self.refs[old] > 1:
                if not self.free_blocks:
                    return False
                (new,) = self._take(1, table[i - 1] if i and self.refs[table[i - 1]] == 1 else None, hint - i)
                with torch.inference_mode():
                    self.k[:, :, new] = self.k[:, :, old]
                    self.v[:, :, new] = self.v[:, :, old]
                self.refs[old] -= 1
                table[i] = new
                self.copies += 1
        return True

    def share(self, source: Sequence[int], n_blocks: int) -> list[int]:
        """A new table referencing the first `n_blocks` blocks of `source` (their counts go up)."""
        table = list(source[:n_blocks])
        for b in table:
            self.refs[b] += 1
        return table

    def release(self, table: list[int]) -> None:
        """Drop `table`'s references (emptying it); blocks nobody references go back to the pool."""
        for b in table:
            self.refs[b] -= 1
            if self.refs[b] == 0:
                self.free_map[b] = 1
                self.free_blocks += 1
                self.claims.pop(b, None)
        table.clear()

    def padded_tables(self, tables: Sequence[Sequence[int]], width: int, rows: int | None = None) -> list[list[int]]:
        """Host rows of `width` block ids (short tables and padding rows filled with the scratch block)."""
        out = [list(t[:width]) + [self.scratch] * (width - len(t)) for t in tables]
        return out + [[self.scratch] * width] * ((rows or len(out)) - len(out))

    # -- copies out of and into a sequence's blocks (session KV) --------------------------------

    def read(self, table: Sequence[int], n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of positions [0, n) of `table`: k, v [layers, kv_heads, n, head_dim]."""
        index = torch.tensor(list(table[: blocks_for(n, self.block_size)]), dtype=torch.long, device=self.device)
        with torch.inference_mode():
            out = []
            for pool in (self.k, self.v):
                out.append(pool.index_select(2, index).flatten(2, 3)[:, :, :n].clone())
        return out[0], out[1]

    def write(self, table: Sequence[int], k: torch.Tensor, v: torch.Tensor) -> None:
        """Write k, v [layers, kv_heads, n, head_dim] into positions [0, n) of `table` (blocks already there)."""
        n, bs = k.shape[2], self.block_size
        blocks = torch.tensor([table[p // bs] for p in range(n)], dtype=torch.long, device=self.device)
        offsets = torch.tensor([p % bs for p in range(n)], dtype=torch.long, device=self.device)
        with torch.inference_mode():
            self.k[:, :, blocks, offsets] = k.to(self.k.device, self.k.dtype)
            self.v[:, :, blocks, offsets] = v.to(self.v.device, self.v.dtype)
