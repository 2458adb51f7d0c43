"""Bucketed decode for the torch engine: fixed shapes per (batch, blocks) bucket, replayed as CUDA graphs on CUDA.

What: `BucketedDecoder(runner, cache, max_batch, capture)` is called like `runner.decode`: host lists of tokens,
positions and block tables in, logits [n, V] out. It pads the batch up to its bucket (`batch_buckets`: powers of
two, and max_batch) with rows whose block table is all scratch block (kvcache.py), and pads every block table to
a width bucket: a power of two of blocks covering at least MIN_LENGTH_BUCKET keys, at most a sequence's
`max_blocks`. Each (batch, width) bucket is one fixed-shape call of `LlamaRunner.decode_step`. With
`capture=True` (CUDA) the step of each bucket is captured once in a `torch.cuda.CUDAGraph` over static input
buffers (tokens, positions, block tables) and replayed: a step then costs one graph launch instead of a few
hundred kernel launches. Without capture (CPU) the same padded step runs eagerly: the tests check on the CPU
that padding and the scratch block change no token.

Why it is safe: the captured graph reads the fused weights and the block pool at fixed addresses; the pool is
allocated once and never moves, and weight updates copy in place (weights.py) — both are so by construction,
and the `gpu` tests check an update is visible to a captured graph. Which blocks a row reads is data (the
table buffer), so one graph serves every sequence. Capture itself runs the step with every row on the
scratch block, so it never writes a real sequence's KV.

How to run: `rollout.engine.cuda_graphs: true` with the engine on CUDA; tests in
tests/unit/engines/test_torch_graph_ready.py (CPU, compile) and test_torch_cuda_graphs.py (`gpu` marker).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from areal_mq.engines.torch.kvcache import blocks_for

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


def width_bucket(length: int, block_size: int, max_blocks: int) -> int:
    """Blocks per row attended for keys up to `length`: a power of two (>= MIN_LENGTH_BUCKET keys), <= max_blocks."""
    need = blocks_for(length, block_size)
    if need > max_blocks:
        raise ValueError(f"decode needs {need} blocks per row, a sequence holds at most {max_blocks}")
    least = blocks_for(MIN_LENGTH_BUCKET, block_size)
    return min(max_blocks, max(least, 1 << (need - 1).bit_length()))


def capture(step: Any, device: Any, pool: Any) -> tuple[Any, Any]:
    """(the CUDA graph of `step()`, its output tensors): two warm-up calls on a side stream (allocator and kernel
    autotuning settle there), then the capture into the shared memory pool."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(2):
            step()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        outputs = step()
    return graph, outputs


@dataclass
class _Graph:
    """One captured bucket: its static inputs, its output, and the graph that maps one to the other."""

    tokens: torch.Tensor
    positions: torch.Tensor
    tables: torch.Tensor
    logits: torch.Tensor
    graph: Any


class BucketedDecoder:
    """Padded, bucketed decode over the block pool; CUDA-graph replay when `capture` (module docstring)."""

    def __init__(self, runner: Any, cache: Any, max_batch: int, capture: bool = False):
        self.runner, self.cache, self.capture = runner, cache, capture
        self.buckets = batch_buckets(max_batch)
        self.max_blocks = min(blocks_for(runner.max_len, cache.block_size), cache.num_blocks)
        self.graphs: dict[tuple[int, int], _Graph] = {}
        self.pool = torch.cuda.graph_pool_handle() if capture else None

    def shape_for(self, positions: Sequence[int]) -> tuple[int, int]:
        """(batch bucket, width bucket in blocks) of a step over rows at `positions`."""
        return (bucket_for(len(positions), self.buckets),
                width_bucket(max(positions) + 1, self.cache.block_size, self.max_blocks))

    def padded(self, tokens: Sequence[int], positions: Sequence[int], tables: Sequence[Sequence[int]],
               batch: int, width: int) -> tuple[list, list, list]:
        """Host lists padded to `batch` rows of `width` blocks: padding rows feed token 0 at position 0, their
        tables all scratch block."""
        pad = batch - len(tokens)
        return (list(tokens) + [0] * pad, list(positions) + [0] * pad,
                self.cache.padded_tables(tables, width, rows=batch))

    @torch.inference_mode()
    def __call__(self, tokens: Sequence[int], positions: Sequence[int],
                 tables: Sequence[Sequence[int]]) -> torch.Tensor:
        batch, width = self.shape_for(positions)
        toks, pos, tabs = self.padded(tokens, positions, tables, batch, width)
        if not self.capture:
            r = self.runner
            return r.decode_step(self.cache.k, self.cache.v, r.index(toks), r.index(pos), r.index_2d(tabs))[: len(tokens)]
        entry = self.graphs.get((batch, width)) or self._capture(batch, width)
        entry.tokens.copy_(torch.tensor(toks, dtype=torch.long), non_blocking=True)
        entry.positions.copy_(torch.tensor(pos, dtype=torch.long), non_blocking=True)
        entry.tables.copy_(torch.tensor(tabs, dtype=torch.long), non_blocking=True)
        entry.graph.replay()
        return entry.logits[: len(tokens)]

    def _capture(self, batch: int, width: int) -> _Graph:
        """Warm up on a side stream, then capture the step of one bucket; every row writes to the scratch block."""
        device = self.cache.device
        tokens = torch.zeros(batch, dtype=torch.long, device=device)
        positions = torch.zeros(batch, dtype=torch.long, device=device)
        tables = torch.full((batch, width), self.cache.scratch, dtype=torch.long, device=device)

        def step() -> torch.Tensor:
            return self.runner.decode_step(self.cache.k, self.cache.v, tokens, positions, tables)

        graph, logits = capture(step, device, self.pool)
        entry = _Graph(tokens, positions, tables, logits, graph)
        self.graphs[(batch, width)] = entry
        return entry


def decode_and_sample(runner: Any, k_cache: torch.Tensor, v_cache: torch.Tensor, tokens: torch.Tensor,
                      positions: torch.Tensor, tables: torch.Tensor, temperatures: torch.Tensor, top_ps: torch.Tensor,
                      top_ks: torch.Tensor, uniforms: torch.Tensor, version: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The whole decode step as a pure tensor function (what `SampledDecoder` captures): the forward
    (`decode_step`), sampling and behaviour logprobs (sampling.py `sample_tensors`, the row's uniform draw an input)
    and the version tag of every new token -> (tokens [B] int64, logprobs [B] float32, versions [B] int64). Writes
    the rows' K/V in place; reads nothing back to the host."""
    from areal_mq.engines.sampling import sample_tensors

    logits = runner.decode_step(k_cache, v_cache, tokens, positions, tables)
    new, logprobs = sample_tensors(logits, temperatures, top_ps, top_ks, uniforms)
    return new, logprobs, version.expand(new.shape[0]).clone()


@dataclass
class _SampledGraph:
    inputs: tuple[torch.Tensor, ...]  # tokens, positions, tables, temperatures, top_ps, top_ks, uniforms, version
    outputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    graph: Any


class SampledDecoder(BucketedDecoder):
    """`decode_and_sample` per (batch, width) bucket, captured whole as one CUDA graph when `capture`: one replay
    per step computes the tokens, logprobs and versions, read back once by the caller (no host sync inside).
    Without capture (CPU) the same padded pure function runs eagerly; tests check both against the eager engine
    step (forward + `sample_tokens`). Not yet the engine's default step (the engine samples outside the graph)."""

    def __init__(self, runner: Any, cache: Any, max_batch: int, capture: bool = False):
        super().__init__(runner, cache, max_batch, capture)
        self.sampled: dict[tuple[int, int], _SampledGraph] = {}

    @torch.inference_mode()
    def step(self, tokens: Sequence[int], positions: Sequence[int], tables: Sequence[Sequence[int]],
             temperatures: Sequence[float], top_ps: Sequence[float], top_ks: Sequence[int], uniforms: torch.Tensor,
             version: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Host lists (and the rows' uniform draws [n], on the cache's device) -> tokens, logprobs, versions [n]."""
        n = len(tokens)
        batch, width = self.shape_for(positions)
        toks, pos, tabs = self.padded(tokens, positions, tables, batch, width)
        pad = batch - n
        device = self.cache.device
        host = (torch.tensor(toks, dtype=torch.long), torch.tensor(pos, dtype=torch.long),
                torch.tensor(tabs, dtype=torch.long),
                torch.tensor(list(temperatures) + [0.0] * pad, dtype=torch.float32),
                torch.tensor(list(top_ps) + [1.0] * pad, dtype=torch.float32),
                torch.tensor(list(top_ks) + [0] * pad, dtype=torch.long))
        u = torch.cat([uniforms.to(device, torch.float32), torch.zeros(pad, dtype=torch.float32, device=device)])
        ver = torch.tensor(int(version), dtype=torch.long)
        if not self.capture:
            args = [t.to(device) for t in host] + [u, ver.to(device)]
            outs = decode_and_sample(self.runner, self.cache.k, self.cache.v, *args)
        else:
            entry = self.sampled.get((batch, width)) or self._capture_sampled(batch, width)
            for buf, value in zip(entry.inputs, [*host, u, ver]):
                buf.copy_(value, non_blocking=True)
            entry.graph.replay()
            outs = entry.outputs
        return outs[0][:n], outs[1][:n], outs[2][:n]

    def _capture_sampled(self, batch: int, width: int) -> _SampledGraph:
        """As `_capture`: warm up on a side stream, capture with every row on the scratch block."""
        device = self.cache.device
        inputs = (torch.zeros(batch, dtype=torch.long, device=device),
                  torch.zeros(batch, dtype=torch.long, device=device),
                  torch.full((batch, width), self.cache.scratch, dtype=torch.long, device=device),
                  torch.zeros(batch, dtype=torch.float32, device=device),
                  torch.ones(batch, dtype=torch.float32, device=device),
                  torch.zeros(batch, dtype=torch.long, device=device),
                  torch.zeros(batch, dtype=torch.float32, device=device),
                  torch.zeros((), dtype=torch.long, device=device))

        def step():
            return decode_and_sample(self.runner, self.cache.k, self.cache.v, *inputs)

        graph, outputs = capture(step, device, self.pool)
        entry = _SampledGraph(inputs, outputs, graph)
        self.sampled[(batch, width)] = entry
        return entry
