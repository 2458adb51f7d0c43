"""The torch engine still produces what it produced before the graph-ready rewrite (issue 25) and the paged KV
cache (issue 42): the same tokens and versions, logprobs within 1e-5, at fixed seeds, on the eager path, on the
bucketed, padded path that CUDA graphs replay and with a pool sized by kv_cache_bytes (golden.py recorded the
reference from the engine before issue 25, with one contiguous KV slot per sequence)."""
from __future__ import annotations

import json

import pytest

from .engine_refs import perturbed_state
from .golden import GOLDEN, PROMPTS, run_scenarios

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def golden():
    return json.loads(GOLDEN.read_text())


@pytest.mark.parametrize("overrides", [{}, {"cuda_graphs": True}, {"kv_cache_bytes": 4 * 2**20},
                                       pytest.param({"decode_attention": "flex", "cuda_graphs": True},
                                                    marks=pytest.mark.slow)],
                         ids=["eager", "bucketed", "static", "flex"])
def test_engine_matches_the_recorded_outputs(make_engine, tiny_tokenizer, hf_tiny, golden, overrides):
    from areal_mq.engines.models import apply_chat_template

    prompts = [apply_chat_template(tiny_tokenizer, t) for t in PROMPTS]
    got = run_scenarios(lambda **kw: make_engine(**{**overrides, **kw}), prompts, perturbed_state(hf_tiny, seed=99))
    assert got.keys() == golden.keys()
    for scenario, outs in golden.items():
        assert got[scenario].keys() == outs.keys(), scenario
        for rid, ref in outs.items():
            out = got[scenario][rid]
            assert out["tokens"] == ref["tokens"], (scenario, rid)
            assert out["versions"] == ref["versions"] and out["finish"] == ref["finish"], (scenario, rid)
            assert out["logprobs"] == pytest.approx(ref["logprobs"], abs=1e-5), (scenario, rid)


def test_the_kv_pool_is_sized_by_kv_cache_bytes_and_refuses_requests_larger_than_it(make_engine):
    from areal_mq.errors import ConfigError, EngineRequestError
    from areal_mq.engines.base import EngineRequest
    from areal_mq.messages import SamplingSpec

    per_token = 2 * 2 * 2 * 16 * 4  # tiny-random-llama, float32: K+V x 2 layers x 2 KV heads x 16 dims x 4 bytes
    engine = make_engine(max_concurrent=3, kv_cache_bytes=per_token * 128, kv_block_size=16)  # 8 blocks, 1 scratch
    assert engine.cache.static and engine.cache.num_blocks == 7 and engine.cache.capacity_tokens == 112
    assert engine.cache.nbytes == per_token * 128
    with pytest.raises(EngineRequestError, match="kv_cache_bytes"):
        engine.submit(EngineRequest("long", [1] * 90, SamplingSpec(max_new_tokens=30)))
    engine.submit(EngineRequest("fits", [1] * 90, SamplingSpec(max_new_tokens=20)))
    with pytest.raises(ConfigError, match="raise kv_cache_bytes to at least"):
        make_engine(max_concurrent=3, kv_cache_bytes=per_token * 48, kv_block_size=16)  # 2 blocks for 3 sequences


def test_cuda_graphs_auto_is_eager_on_the_cpu_and_true_buckets_without_capture(make_engine):
    assert make_engine().decoder is None  # auto (the default): nothing to capture on the CPU, no padding paid
    bucketed = make_engine(cuda_graphs=True)
    assert bucketed.decoder is not None and not bucketed.decoder.capture
