"""The torch engine's decode under CUDA graphs (`gpu` marker: skipped where torch sees no CUDA device).

On the GPU: (1) the engine with `cuda_graphs: true` (explicit capture per bucket, graphs.py) gives the same greedy
tokens as the eager engine on the same device, and its logprobs within float32 tolerance (2e-4);
(2) an in-place weight update is visible to an already captured graph (the graph reads the fused weights at their
addresses); (3) `torch.compile(decode_step, mode="reduce-overhead")` (torch's own CUDA graphs) equals eager.
How to run: `python -m pytest -q -m gpu tests/unit/engines/test_torch_cuda_graphs.py` on a CUDA machine.
"""
from __future__ import annotations

import pytest
import torch

from areal_mq.engines.base import EngineRequest
from areal_mq.messages import SamplingSpec

from .engine_refs import perturbed_state
from .test_torch_engine import run_all

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600)]


def _engine(tiny_model_dir, tiny_tokenizer, **overrides):
    from areal_mq.engines.config import EngineConfig
    from areal_mq.engines.torch.engine import TorchEngine

    cfg = EngineConfig(**{"seed": 0, "max_concurrent": 4, **overrides})
    return TorchEngine(tiny_model_dir, cfg, dtype="float32", tokenizer=tiny_tokenizer, device="cuda")


def _greedy(engine, prompts, n=24):
    for i, p in enumerate(prompts):
        engine.submit(EngineRequest(f"g{i}", p, SamplingSpec(temperature=0, max_new_tokens=n + 3 * i, ignore_eos=True)))
    return run_all(engine)


def test_auto_captures_on_cuda(tiny_model_dir, tiny_tokenizer):
    assert _engine(tiny_model_dir, tiny_tokenizer).decoder.capture  # the default, auto, is on for CUDA


def test_captured_decode_equals_eager_on_cuda(tiny_model_dir, tiny_tokenizer, prompts):
    eager = _greedy(_engine(tiny_model_dir, tiny_tokenizer, cuda_graphs=False), prompts)
    graphed_engine = _engine(tiny_model_dir, tiny_tokenizer, cuda_graphs=True)
    graphed = _greedy(graphed_engine, prompts)
    assert graphed_engine.decoder.capture and graphed_engine.decoder.graphs  # it really replayed graphs
    for rid, out in eager.items():
        assert graphed[rid].output_ids.tolist() == out.output_ids.tolist()
        torch.testing.assert_close(torch.from_numpy(graphed[rid].logprobs), torch.from_numpy(out.logprobs),
                                   atol=2e-4, rtol=1e-4)


def test_in_place_update_is_visible_to_a_captured_graph(tiny_model_dir, tiny_tokenizer, hf_tiny, prompts):
    state = perturbed_state(hf_tiny, seed=99)
    graphed = _engine(tiny_model_dir, tiny_tokenizer, cuda_graphs=True)
    _greedy(graphed, prompts[:2])  # captures the buckets these prompts use
    captured = dict(graphed.decoder.graphs)
    graphed.update_weights(1, tensors=state)
    after = _greedy(graphed, prompts[:2])
    assert graphed.decoder.graphs.keys() >= captured.keys()
    assert all(graphed.decoder.graphs[k] is v for k, v in captured.items())  # replayed, not re-captured
    fresh = _engine(tiny_model_dir, tiny_tokenizer, cuda_graphs=False)  # eager, loaded with the new weights from the start
    fresh.update_weights(1, tensors=state)
    want = _greedy(fresh, prompts[:2])
    for rid, out in want.items():
        assert after[rid].output_ids.tolist() == out.output_ids.tolist()
        assert after[rid].versions.tolist() == [1] * len(out.output_ids)


def test_reduce_overhead_compile_of_the_decode_step(tiny_model_dir, tiny_tokenizer):
    from areal_mq.engines.torch.graphs import BucketedDecoder

    engine = _engine(tiny_model_dir, tiny_tokenizer, cuda_graphs=True)
    runner, cache = engine.runner, engine.cache
    torch._dynamo.mark_static_address(cache.k)
    torch._dynamo.mark_static_address(cache.v)
    step = torch.compile(runner.decode_step, mode="reduce-overhead", fullgraph=True)
    decoder = BucketedDecoder(runner, cache, max_batch=4)
    tables = [[], [], []]
    for table in tables:
        assert cache.ensure(table, 64)
    with torch.inference_mode():
        for s in range(4):
            toks, pos, tabs = decoder.padded([5 + s, 6 + s, 7 + s], [3 + s, 4 + s, 5 + s], tables, 4, 4)
            toks, pos, tabs = runner.index(toks), runner.index(pos), runner.index_2d(tabs)
            want = runner.decode_step(cache.k, cache.v, toks, pos, tabs).clone()
            got = step(cache.k, cache.v, toks, pos, tabs).clone()
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
