"""The decode step is ready for CUDA graphs, checked on the CPU: `torch.compile(decode_step, fullgraph=True)` traces
it in one graph (no graph break), steps of one (batch, blocks) bucket reuse it (no recompile) with the block
tables as an input, and the compiled step computes what the eager one does (logits and the K/V it writes)."""
from __future__ import annotations

import pytest
import torch

from areal_mq.engines.torch.forward import LlamaRunner
from areal_mq.engines.torch.graphs import BucketedDecoder

pytestmark = pytest.mark.timeout(300)


@pytest.fixture
def runner(hf_tiny):
    import copy

    torch._dynamo.reset()
    yield LlamaRunner(copy.deepcopy(hf_tiny), max_len=256)
    torch._dynamo.reset()


def _cache_with_rows(runner, lengths=(64, 64, 64)):
    """A pool with three sequences' block tables (rows 0..2) of room `lengths`."""
    cache = runner.new_cache(32, block_size=16)
    tables = [[] for _ in lengths]
    for table, n in zip(tables, lengths):
        assert cache.ensure(table, n)
    return cache, tables


def _bucket_steps(runner, cache, tables, n_steps=4):
    """Inputs of n steps of one bucket (batch 4 with one padding row, 4 blocks = 64 keys): positions advance."""
    decoder = BucketedDecoder(runner, cache, max_batch=4)
    steps = []
    for s in range(n_steps):
        pos = [20 + s, 5 + s, 40 + s]
        assert decoder.shape_for(pos) == (4, 4)
        toks, pos, tabs = decoder.padded([11 + s, 22 + s, 33 + s], pos, tables, 4, 4)
        steps.append((runner.index(toks), runner.index(pos), runner.index_2d(tabs)))
    return steps


def test_decode_step_compiles_in_one_graph_without_recompiles(runner):
    from torch._dynamo.testing import CompileCounterWithBackend

    cache, tables = _cache_with_rows(runner)
    steps = _bucket_steps(runner, cache, tables)
    with torch.inference_mode():
        explained = torch._dynamo.explain(runner.decode_step)(cache.k, cache.v, *steps[0])
        assert explained.graph_break_count == 0 and explained.graph_count == 1, explained.break_reasons
        torch._dynamo.reset()
        counter = CompileCounterWithBackend("aot_eager")  # functionalizes the in-place KV writes, as inductor does
        compiled = torch.compile(runner.decode_step, backend=counter, fullgraph=True)
        for step in steps:
            compiled(cache.k, cache.v, *step)
    assert counter.frame_count == 1  # one compile for every step of the bucket


def test_compiled_step_equals_the_eager_step(runner):
    (eager_cache, tables), (compiled_cache, _) = _cache_with_rows(runner), _cache_with_rows(runner)
    for cache in (eager_cache, compiled_cache):  # some history in rows 0..2, the same in both
        runner.extend(cache, tables, [0, 0, 0], [list(range(3, 23)), list(range(50, 55)), list(range(7, 47))])
    compiled = torch.compile(runner.decode_step, backend="aot_eager", fullgraph=True)
    with torch.inference_mode():
        for step in _bucket_steps(runner, eager_cache, tables):
            want = runner.decode_step(eager_cache.k, eager_cache.v, *step)
            got = compiled(compiled_cache.k, compiled_cache.v, *step)
            torch.testing.assert_close(got, want)
    used = sorted({b for t in tables for b in t} | {eager_cache.scratch})  # blocks never handed out hold garbage
    torch.testing.assert_close(compiled_cache.k[:, :, used], eager_cache.k[:, :, used])  # KV written, in place
    torch.testing.assert_close(compiled_cache.v[:, :, used], eager_cache.v[:, :, used])


def test_padding_rows_write_only_the_scratch_block(runner):
    cache, tables = _cache_with_rows(runner, (16, 16, 16, 16))  # one block each: 0, 1, 2, 3
    runner.extend(cache, tables, [0] * 4, [list(range(5, 15))] * 4)
    before = cache.k.clone()
    BucketedDecoder(runner, cache, max_batch=4)([1], [10], tables[:1])  # batch 1: no padding; batch 3 -> bucket 4
    BucketedDecoder(runner, cache, max_batch=4)([1, 2, 3], [11, 12, 13], tables[:3])
    # blocks never handed out hold uninitialised memory, which may hold NaNs (NaN != NaN): compare NaN-aware
    same = (cache.k == before) | (cache.k.isnan() & before.isnan())
    changed = (~same).transpose(1, 2).flatten(2).any(-1)  # [layers, blocks + 1]
    assert changed[:, :3].all() and not changed[:, 3:cache.scratch].any() and changed[:, cache.scratch].all()
