"""The decode step is ready for CUDA graphs, checked on the CPU: `torch.compile(decode_step, fullgraph=True)` traces
it in one graph (no graph break), steps of one (batch, length) bucket reuse it (no recompile), and the compiled
step computes what the eager one does (logits and the K/V it writes)."""
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


def _bucket_steps(runner, cache, n_steps=4):
    """Inputs of n steps of one bucket (batch 4 with one padding row, keys 64): positions advance, rows differ."""
    decoder = BucketedDecoder(runner, cache, max_batch=4)
    steps = []
    for s in range(n_steps):
        toks, pos, slots = decoder.padded([11 + s, 22 + s, 33 + s], [20 + s, 5 + s, 40 + s], 4)
        assert decoder.shape_for(pos[:3]) == (4, 64)
        steps.append((runner.index(toks), runner.index(pos), runner.index(slots), 64))
    return steps


def test_decode_step_compiles_in_one_graph_without_recompiles(runner):
    from torch._dynamo.testing import CompileCounterWithBackend

    cache = runner.new_cache(4, capacity=128)
    steps = _bucket_steps(runner, cache)
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
    eager_cache, compiled_cache = runner.new_cache(4, capacity=128), runner.new_cache(4, capacity=128)
    for cache in (eager_cache, compiled_cache):  # some history in slots 0..2, the same in both
        runner.extend(cache, [0, 1, 2], [0, 0, 0], [list(range(3, 23)), list(range(50, 55)), list(range(7, 47))])
    compiled = torch.compile(runner.decode_step, backend="aot_eager", fullgraph=True)
    with torch.inference_mode():
        for step in _bucket_steps(runner, eager_cache):
            want = runner.decode_step(eager_cache.k, eager_cache.v, *step)
            got = compiled(compiled_cache.k, compiled_cache.v, *step)
            torch.testing.assert_close(got, want)
    torch.testing.assert_close(compiled_cache.k, eager_cache.k)  # the in-place KV writes happened, in place
    torch.testing.assert_close(compiled_cache.v, eager_cache.v)


def test_padding_rows_write_only_the_scratch_slot(runner):
    cache = runner.new_cache(4, capacity=128)
    runner.extend(cache, [0, 1, 2, 3], [0] * 4, [list(range(5, 15))] * 4)
    before = cache.k.clone()
    BucketedDecoder(runner, cache, max_batch=4)([1], [10])  # batch 1: no padding; then batch 3 -> bucket 4
    BucketedDecoder(runner, cache, max_batch=4)([1, 2, 3], [11, 12, 13])
    changed = (cache.k != before).flatten(2).any(-1)  # [layers, slots + 1]
    assert changed[:, :3].all() and not changed[:, 3].any() and changed[:, 4].all()  # slot 3 untouched
