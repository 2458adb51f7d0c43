"""FlexAttention decode (flex.py) against the plain path (gather / in-place views) and HF: the same logits on block
tables of every layout (shared prompt runs, fragmented tables, partial and full last blocks, padding rows), and the
same greedy tokens through the engine. The compiled kernel is built once per pool size and padded batch (a few
seconds to ~20 s on a cold cache), so these tests share one pool size where they can."""
from __future__ import annotations

import copy

import pytest
import torch

from areal_mq.engines.base import EngineRequest
from areal_mq.messages import SamplingSpec

pytestmark = pytest.mark.timeout(300)

POOL_BLOCKS = 64
BS = 16


@pytest.fixture(scope="module")
def runners(hf_tiny):
    from areal_mq.engines.torch.forward import LlamaRunner

    model = copy.deepcopy(hf_tiny)
    return LlamaRunner(model, max_len=512), LlamaRunner(model, max_len=512, attention="flex")


def _filled_cache(runner, lengths, layout, seed=0):
    """A pool holding KV of `lengths` tokens per row, tables laid out as `layout` says."""
    cache = runner.new_cache(POOL_BLOCKS, BS)
    g = torch.Generator().manual_seed(seed)
    tables = [[] for _ in lengths]
    if layout == "fragmented":  # interleaved blocks: no row is a run of consecutive blocks
        for j in range(max(lengths) // BS + 1):
            for t, n in zip(tables, lengths):
                if j * BS <= n:
                    assert cache.ensure(t, (j + 1) * BS)
    elif layout == "shared":  # rows 1.. share row 0's first two full blocks (a prompt), then grow apart
        assert cache.ensure(tables[0], lengths[0] + 1)
        for t, n in zip(tables[1:], lengths[1:]):
            t.extend(cache.share(tables[0], 2))
            assert cache.ensure(t, n + 1)
    else:
        for t, n in zip(tables, lengths):
            assert cache.ensure(t, n + 1)
    for t in (cache.k, cache.v):  # every position any row may read, written (the pool starts uninitialised)
        t.copy_(torch.randn(t.shape, generator=g))
    return cache, tables


@pytest.mark.parametrize("layout", ["runs", "fragmented", "shared"])
def test_flex_decode_equals_the_plain_path(runners, layout):
    plain, flex = runners
    lengths = [40, 15, 16, 47, 63, 33]  # last block partial, exactly one block, block boundaries
    cache, tables = _filled_cache(plain, lengths, layout)
    k0, v0 = cache.k.clone(), cache.v.clone()
    tokens, positions = [3, 7, 11, 5, 2, 9], lengths
    ref = plain.decode(cache, tokens, positions, tables)
    k_ref, v_ref = cache.k.clone(), cache.v.clone()
    cache.k.copy_(k0)
    cache.v.copy_(v0)
    got = flex.decode(cache, tokens, positions, tables)
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(cache.k, k_ref)  # the same KV written, at the same places
    torch.testing.assert_close(cache.v, v_ref)


def test_flex_decode_on_padded_buckets_equals_exact_rows(runners):
    """The bucketed decoder (graphs.py; what CUDA graphs replay) pads rows onto the scratch block."""
    from areal_mq.engines.torch.graphs import BucketedDecoder

    plain, flex = runners
    lengths = [20, 50, 31]
    cache, tables = _filled_cache(plain, lengths, "runs")
    k0, v0 = cache.k.clone(), cache.v.clone()
    ref = plain.decode(cache, [1, 2, 3], lengths, tables)
    cache.k.copy_(k0)
    cache.v.copy_(v0)
    got = BucketedDecoder(flex, cache, max_batch=8)([1, 2, 3], lengths, tables)
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)


def test_the_block_mask_lists_each_row_its_own_blocks():
    from areal_mq.engines.torch.flex import FlexKernels, padded_rows

    flex = FlexKernels(compiled=False).for_pool(BS, POOL_BLOCKS + 1)
    tables = torch.tensor([[4, 5, 9], [7, 64, 64]])
    mask = flex.mask(tables, torch.tensor([40, 15]))
    assert mask.padded_rows == padded_rows(2) and mask.rows == 2
    assert mask.full_num.flatten()[:3].tolist() == [2, 0, 0]  # full blocks before the partial one; padding: none
    assert mask.kv_num.flatten()[:3].tolist() == [1, 1, 0]
    assert mask.full_idx[0, 0, 0, :2].tolist() == [4, 5]
    assert mask.last_block[:2].tolist() == [9, 7] and mask.last_off[:2].tolist() == [40 % BS, 15]


def test_the_engine_on_flex_gives_hf_greedy_tokens_and_the_plain_engines_logprobs(make_engine, hf_tiny, prompts):
    plain, flex = make_engine(), make_engine(decode_attention="flex")
    assert flex.runner.attention == "flex" and plain.runner.attention == "plain"  # auto on the CPU: plain
    for engine in (plain, flex):
        for i, p in enumerate(prompts):
            engine.submit(EngineRequest(f"f{i}", p, SamplingSpec(temperature=0, max_new_tokens=12, ignore_eos=True)))
    outs = []
    for engine in (plain, flex):
        got = {}
        while engine.has_work():
            got.update({o.request_id: o for o in engine.step()})
        outs.append(got)
    for i, p in enumerate(prompts):
        ref = hf_tiny.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                               max_new_tokens=12, do_sample=False)[0, len(p):].tolist()
        a, b = outs[0][f"f{i}"], outs[1][f"f{i}"]
        assert b.output_ids.tolist() == ref == a.output_ids.tolist()
        assert b.logprobs.tolist() == pytest.approx(a.logprobs.tolist(), abs=1e-5)
