"""Bucketed decode for the torch engine: fixed shapes per (batch, length) bucket, replayed as CUDA graphs on CUDA.

What: `BucketedDecoder(runner, cache, max_batch, capture)` is called like `runner.decode`: host lists of tokens
and positions in, logits [n, V] out. It pads the batch up to its bucket (`batch_buckets`: powers of two, and
max_batch) with rows that write their K/V into the cache's scratch slot, and rounds the key length up to a
power of two (at least 64, at most the cache capacity). Each (batch, length) bucket is one fixed-shape call of
`LlamaRunner.decode_step`. With `capture=True` (CUDA) the step of each bucket is captured once in a
`torch.cuda.CUDAGraph` over static input buffers and replayed: a step then costs one graph launch instead of a
few hundred kernel launches. Without capture (CPU) the same padded step runs eagerly: the tests check on the
CPU that padding and the scratch slot change no token.

Why it is safe: the captured graph reads the fused weights and the KV cache at fixed addresses, so the cache
must be static (kvcache.py, sized by `kv_cache_bytes`) and weight updates copy in place (weights.py) — both
are so by construction, and the `gpu` tests check an update is visible to a captured graph. Capture itself
runs the step with every row on the scratch slot, so it never writes a real sequence's KV.

How to run: `rollout.engine.cuda_graphs: true` with the engine on CUDA; tests in
tests/unit/engines/test_torch_graph_ready.py (CPU, compile) and test_torch_cuda_graphs.py (`gpu` marker).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

MIN_LENGTH_BUCKET = 64


def batch_buckets(max_batch: int) -> list[int]:
    """Batch sizes the decode step is built for: 1, 2, 4, ... below max_batch, and max_batch."""
    sizes, b = [], 1
    while b < max_batch:
        sizes.append(b)
        b *= 2
    return sizes + [max_batch]


def bucket_for(n: int, buckets: Sequence[int]) -> int:
    """The smallest bucket holding n rows."""
    for b in buckets:
        if b >= n:
            return b
    raise ValueError(f"{n} rows exceed the largest decode bucket {buckets[-1]}")


def length_bucket(length: int, capacity: int) -> int:
    """Keys attended: `length` rounded up to a power of two (>= MIN_LENGTH_BUCKET), at most `capacity`."""
    if length > capacity:
        raise ValueError(f"decode needs {length} positions, the KV cache holds {capacity}")
    return min(capacity, max(MIN_LENGTH_BUCKET, 1 << (length - 1).bit_length()))


@dataclass
class _Graph:
    """One captured bucket: its static inputs, its output, and the graph that maps one to the other."""

    tokens: torch.Tensor
    positions: torch.Tensor
    write_slots: torch.Tensor
    logits: torch.Tensor
    graph: Any


class BucketedDecoder:
    """Padded, bucketed decode over a static cache; CUDA-graph replay when `capture` (module docstring)."""

    def __init__(self, runner: Any, cache: Any, max_batch: int, capture: bool = False):
        if capture and not cache.static:
            raise ValueError("CUDA graphs need a static KV cache (set kv_cache_bytes, or run on CUDA)")
        self.runner, self.cache, self.capture = runner, cache, capture
        self.buckets = batch_buckets(max_batch)
        self.graphs: dict[tuple[int, int], _Graph] = {}
        self.pool = torch.cuda.graph_pool_handle() if capture else None

    def shape_for(self, positions: Sequence[int]) -> tuple[int, int]:
        """(batch bucket, length bucket) of a step over rows at `positions`."""
        return bucket_for(len(positions), self.buckets), length_bucket(max(positions) + 1, self.cache.capacity)

    def padded(self, tokens: Sequence[int], positions: Sequence[int], batch: int) -> tuple[list, list, list]:
        """Host lists padded to `batch` rows: padding rows feed token 0 at position 0 into the scratch slot."""
        pad = batch - len(tokens)
        return (list(tokens) + [0] * pad, list(positions) + [0] * pad,
                list(range(len(tokens))) + [self.cache.scratch] * pad)

    @torch.inference_mode()
    def __call__(self, tokens: Sequence[int], positions: Sequence[int]) -> torch.Tensor:
        batch, length = self.shape_for(positions)
        toks, pos, slots = self.padded(tokens, positions, batch)
        if not self.capture:
            index = self.runner.index
            return self.runner.decode_step(self.cache.k, self.cache.v, index(toks), index(pos), index(slots),
                                           length)[: len(tokens)]
        entry = self.graphs.get((batch, length)) or self._capture(batch, length)
        for buf, values in ((entry.tokens, toks), (entry.positions, pos), (entry.write_slots, slots)):
            buf.copy_(torch.tensor(values, dtype=torch.long), non_blocking=True)
        entry.graph.replay()
        return entry.logits[: len(tokens)]

    def _capture(self, batch: int, length: int) -> _Graph:
        """Warm up on a side stream, then capture the step of one bucket; every row writes to the scratch slot."""
        device = self.cache.device
        tokens = torch.zeros(batch, dtype=torch.long, device=device)
        positions = torch.zeros(batch, dtype=torch.long, device=device)
        slots = torch.full((batch,), self.cache.scratch, dtype=torch.long, device=device)

        def step() -> torch.Tensor:
            return self.runner.decode_step(self.cache.k, self.cache.v, tokens, positions, slots, length)

        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(2):
                step()
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            logits = step()
        entry = _Graph(tokens, positions, slots, logits, graph)
        self.graphs[(batch, length)] = entry
        return entry
