"""The KV block pool's bookkeeping, with no tensors: who holds which block, where a new run goes, what is shared.

What: `BlockPool` is the pure half of the torch engine's paged KV cache (engines/torch/kvcache.py `PagedKVCache`
adds the k / v tensors and overrides the two hooks, `_fresh` to zero blocks handed out for the first time and
`_copy` for copy-on-write). A sequence owns a block table, the list of block ids holding its positions in order:
position p lives in block table[p // block_size] at offset p % block_size. Blocks are taken as tokens are produced
(`ensure`), shared by reference count (`share`; a write into a shared block first copies it: `writable`), and
returned when a sequence leaves (`release`). Placement (runs of consecutive blocks, `hint`) is explained in
kvcache.py's docstring.

Why pure: the engine's scheduler (engines/scheduler.py) decides admission, prefill and preemption on this
bookkeeping alone, so the same code runs in the engine and, in virtual time at a config's full numbers, in the
scheduler twin (engines/twin.py) that `areal-mq plan` reports from. Block `scratch` (id num_blocks) belongs to no
sequence.
"""
from __future__ import annotations

import re
from typing import Sequence


def blocks_for(tokens: int, block_size: int) -> int:
    """Blocks that hold `tokens` positions."""
    return -(-tokens // block_size)


class BlockPool:
    """Block ids, reference counts, free map and run placement (module docstring). No method touches a tensor."""

    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks, self.block_size, self.scratch = num_blocks, block_size, num_blocks
        self.refs = [0] * num_blocks
        self.free_map = bytearray(b"\x01") * num_blocks  # 1 where a block is free
        self.free_blocks = num_blocks
        self.touched = bytearray(num_blocks)  # 1 once a block was handed out (`_fresh` ran for it)
        self.claims: dict[int, int] = {}  # last block of a run -> end of the room that run claimed to grow into
        self.peak_used = 0
        self.copies = 0  # copy-on-write block copies

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def used(self) -> int:
        return self.num_blocks - self.free_blocks

    def _fresh(self, blocks: list[int]) -> None:
        """Blocks handed out for the first time (the tensor pool zeroes them); nothing to do here."""

    def _copy(self, old: int, new: int) -> None:
        """Copy-on-write: block `new` takes `old`'s contents (the tensor pool copies K and V); nothing here."""

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
            self._fresh(new)
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
                self._copy(old, new)
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
                self._freed(b)
        table.clear()

    def _freed(self, block: int) -> None:
        """Block `block` went back to the pool: the run it ended claims no room any more."""
        self.claims.pop(block, None)
