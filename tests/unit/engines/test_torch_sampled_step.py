"""The whole decode step as one pure tensor function (graphs.py `decode_and_sample`, `SampledDecoder`): sampling,
logprobs and version tags computed with the forward, nothing read back inside. On the CPU its output equals the
engine's eager step (forward + sampling.py `sample_tokens` with the same draws); on CUDA (`gpu`) the captured
graph equals the uncaptured function."""
from __future__ import annotations

import copy

import pytest
import torch

TEMPS = [0.0, 1.0, 0.7, 1.3, 0.9]
TOP_PS = [1.0, 1.0, 0.9, 1.0, 0.95]
TOP_KS = [0, 0, 0, 50, 20]  # greedy, plain, top-p, top-k, both


def _draws(seeds, device="cpu"):
    """Each row's generator and its next uniform (drawn from a copy, so the generator itself is still fresh)."""
    gens = [torch.Generator(device=device).manual_seed(s) for s in seeds]
    u = [torch.rand((), generator=torch.Generator(device=device).manual_seed(s), device=device) for s in seeds]
    return gens, torch.stack(u)


def test_sample_tensors_equals_sample_tokens():
    from areal_mq.engines.sampling import sample_tensors, sample_tokens

    logits = torch.randn(len(TEMPS), 500, generator=torch.Generator().manual_seed(1)) * 3
    gens, u = _draws(range(len(TEMPS)))
    ref_tokens, ref_lp = sample_tokens(logits, TEMPS, TOP_PS, TOP_KS, [g if t > 0 else None for g, t in zip(gens, TEMPS)])
    tokens, lp = sample_tensors(logits, torch.tensor(TEMPS), torch.tensor(TOP_PS), torch.tensor(TOP_KS), u)
    assert tokens.tolist() == ref_tokens.tolist()
    assert torch.equal(lp, ref_lp)


def _setup(hf_tiny, device="cpu"):
    from areal_mq.engines.torch.forward import LlamaRunner

    runner = LlamaRunner(copy.deepcopy(hf_tiny).to(device), max_len=256)
    cache = runner.new_cache(48, 16)
    tables, lengths = [], [30, 17, 45, 8, 60]
    for n in lengths:
        t: list[int] = []
        assert cache.ensure(t, n + 1)
        tables.append(t)
    chunks = [[(7 * i + j) % 200 + 3 for j in range(n)] for i, n in enumerate(lengths)]
    runner.extend(cache, tables, [0] * len(lengths), chunks)
    return runner, cache, tables, lengths


def test_the_pure_step_equals_the_eager_engine_step_on_the_cpu(hf_tiny):
    from areal_mq.engines.sampling import sample_tokens
    from areal_mq.engines.torch.graphs import SampledDecoder

    runner, cache, tables, lengths = _setup(hf_tiny)
    decoder = SampledDecoder(runner, cache, max_batch=8)
    tokens = [11, 12, 13, 14, 15]
    gens, u = _draws([5, 6, 7, 8, 9])
    logits = decoder(tokens, lengths, tables)  # the same padded forward, then the engine's sampling
    ref_tokens, ref_lp = sample_tokens(logits, TEMPS, TOP_PS, TOP_KS, gens)
    new, lp, versions = decoder.step(tokens, lengths, tables, TEMPS, TOP_PS, TOP_KS, u, version=3)
    assert new.tolist() == ref_tokens.tolist()
    assert torch.equal(lp, ref_lp)
    assert versions.tolist() == [3] * 5


@pytest.mark.gpu
@pytest.mark.timeout(600)
def test_the_captured_step_equals_the_uncaptured_one_on_cuda(hf_tiny):
    from areal_mq.engines.torch.graphs import SampledDecoder

    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    runner, cache, tables, lengths = _setup(hf_tiny, "cuda")
    k0, v0 = cache.k.clone(), cache.v.clone()
    tokens = [11, 12, 13, 14, 15]
    _, u = _draws([5, 6, 7, 8, 9], "cuda")
    eager = SampledDecoder(runner, cache, max_batch=8).step(tokens, lengths, tables, TEMPS, TOP_PS, TOP_KS, u, 2)
    cache.k.copy_(k0)
    cache.v.copy_(v0)
    captured = SampledDecoder(runner, cache, max_batch=8, capture=True)
    got = captured.step(tokens, lengths, tables, TEMPS, TOP_PS, TOP_KS, u, 2)
    got = captured.step(tokens, lengths, tables, TEMPS, TOP_PS, TOP_KS, u, 2)  # a replay of the captured graph
    assert got[0].tolist() == eager[0].tolist() and got[2].tolist() == eager[2].tolist()
    torch.testing.assert_close(got[1], eager[1], atol=2e-4, rtol=0)
