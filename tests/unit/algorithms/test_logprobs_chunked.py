"""chunked_logprobs (areal_mq/algorithms/logprobs.py) against the full-logits computation it replaces: the same
logprobs, entropies and gradients wrt hidden states, LM-head weight and bias, in fp32, for chunk sizes that
divide N, do not, or exceed it; and a deterministic peak-memory count (live tensor bytes, on the meta device)
showing it keeps a quarter or less of the full computation's memory at Qwen2.5's 151,936-token vocabulary.

    python -m pytest tests/unit/algorithms/test_logprobs_chunked.py
"""
from __future__ import annotations

import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from areal_mq.algorithms.logprobs import chunk_tokens_for, chunked_logprobs, full_logprobs, lm_head_of

QWEN25_VOCAB = 151_936


def inputs(n, h=16, v=300, bias=False, device="cpu", seed=0):
    gen = torch.Generator().manual_seed(seed)
    make = lambda *shape: torch.randn(*shape, generator=gen).to(device).requires_grad_()  # noqa: E731
    hidden, weight = make(n, h), make(v, h)
    b = make(v) if bias else None
    targets = torch.randint(0, v, (n,), generator=gen).to(device)
    upstream = torch.randn(n, generator=gen).to(device)  # a loss weighting each token differently
    return hidden, weight, b, targets, upstream


def values_and_grads(fn, hidden, weight, bias, targets, upstream, **kw):
    logp, entropy = fn(hidden, weight, targets, with_entropy=True, bias=bias, **kw)
    params = [hidden, weight] + ([bias] if bias is not None else [])
    grads = torch.autograd.grad((logp * upstream).sum(), params, allow_unused=True)
    return logp.detach(), entropy, grads


@pytest.mark.parametrize("chunk", [1, 7, 64, 1000])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("bias", [False, True])
def test_equals_full_computation(chunk, temperature, bias):
    args = inputs(50, bias=bias)  # 50 rows: 7 does not divide it, 1000 exceeds it
    want = values_and_grads(full_logprobs, *args, temperature=temperature)
    got = values_and_grads(chunked_logprobs, *args, temperature=temperature, chunk_tokens=chunk)
    assert got[0].dtype == got[1].dtype == torch.float32
    for g, w in zip([got[0], got[1], *got[2]], [want[0], want[1], *want[2]]):
        assert g.shape == w.shape and relative_error(g, w) < 2e-6  # measured <= 6e-7; fp32 vs fp64 is ~5e-7


def relative_error(got, want):
    """||got - want|| / ||want||, in fp64: the two fp32 computations round differently, element by element."""
    return ((got.double() - want.double()).norm() / want.double().norm()).item()


def test_temperature_zero_means_no_division():
    hidden, weight, _, targets, _ = inputs(9)
    greedy, _ = chunked_logprobs(hidden, weight, targets, 0.0, chunk_tokens=4)
    plain, _ = full_logprobs(hidden, weight, targets, 1.0)
    torch.testing.assert_close(greedy, plain, rtol=1e-6, atol=1e-5)


def test_no_tokens():
    hidden, weight, bias, targets, _ = inputs(0, bias=True)
    logp, entropy = chunked_logprobs(hidden, weight, targets, 0.7, chunk_tokens=4, with_entropy=True, bias=bias)
    assert logp.shape == entropy.shape == (0,)
    logp.sum().backward()
    assert hidden.grad.shape == (0, 16) and not weight.grad.any() and not bias.grad.any()


def test_entropy_only_when_asked_and_without_grad():
    hidden, weight, _, targets, _ = inputs(5)
    assert chunked_logprobs(hidden, weight, targets, 1.0, chunk_tokens=2)[1] is None
    logp, entropy = chunked_logprobs(hidden, weight, targets, 1.0, chunk_tokens=2, with_entropy=True)
    assert logp.requires_grad and not entropy.requires_grad


def test_bf16_autocast_matmul_and_fp32_softmax():
    """Under a bf16 autocast the head's matmul runs in bf16 (as the model's lm_head would), the softmax in fp32,
    and the gradients come back in the parameters' dtype."""
    hidden, weight, _, targets, upstream = inputs(20)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = values_and_grads(full_logprobs, hidden, weight, None, targets, upstream, temperature=0.7)
        got = values_and_grads(chunked_logprobs, hidden, weight, None, targets, upstream, temperature=0.7,
                               chunk_tokens=6)
    assert got[0].dtype == torch.float32 and [g.dtype for g in got[2]] == [torch.float32] * 2
    torch.testing.assert_close(got[0], want[0], rtol=1e-3, atol=1e-3)
    for g, w in zip(got[2], want[2]):
        torch.testing.assert_close(g, w, rtol=2e-2, atol=2e-2)
    fp32 = full_logprobs(hidden, weight, targets, 0.7)[0]
    assert not torch.equal(got[0], fp32.detach())  # the bf16 matmul did happen


def test_chunk_size_is_computed_from_the_vocabulary():
    assert chunk_tokens_for(QWEN25_VOCAB) == 256 * 2**20 // (4 * QWEN25_VOCAB) == 441
    assert chunk_tokens_for(49_152, budget_mib=512) == 2 * chunk_tokens_for(49_152)
    assert chunk_tokens_for(10**9, budget_mib=1) == 1


def tiny_causal_lm(family, **extra):
    import transformers

    config_cls = getattr(transformers, f"{family}Config")
    config = config_cls(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                        num_attention_heads=2, num_key_value_heads=2, head_dim=8, **extra)
    torch.manual_seed(0)
    return getattr(transformers, f"{family}ForCausalLM")(config).eval()


@pytest.mark.parametrize("tied", [False, True])
def test_lm_head_of_llama_gives_the_models_logprobs(tied):
    model = tiny_causal_lm("Llama", tie_word_embeddings=tied)
    weight, bias = lm_head_of(model)
    assert weight is model.lm_head.weight and bias is None
    assert (weight is model.model.embed_tokens.weight) == tied
    ids = torch.randint(0, 64, (1, 12))
    with torch.no_grad():
        want = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), -1).gather(-1, ids[0, 1:, None])[:, 0]
        hidden = model.model(input_ids=ids).last_hidden_state[0, :-1]
        got, _ = chunked_logprobs(hidden, weight, ids[0, 1:], 1.0, chunk_tokens=5)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-5)


def test_lm_head_of_refuses_softcapped_logits():
    model = tiny_causal_lm("Gemma2", final_logit_softcapping=30.0)
    with pytest.raises(NotImplementedError, match="final_logit_softcapping"):
        lm_head_of(model)


class LiveBytes(TorchDispatchMode):
    """Peak bytes of tensor storages created while active and still referenced (freed when their last tensor
    goes): a deterministic count of what autograd and the code keep alive, unlike RSS. Storages of `existing`
    tensors (inputs, parameters) are not counted."""

    def __init__(self, *existing):
        super().__init__()
        self.keep = existing
        self.seen = {id(t.untyped_storage()) for t in existing}
        self.live = self.peak = 0

    def _free(self, key, nbytes):
        self.seen.discard(key)
        self.live -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and id(t.untyped_storage()) not in self.seen:
                storage = t.untyped_storage()
                self.seen.add(id(storage))
                self.live += storage.nbytes()
                self.peak = max(self.peak, self.live)
                weakref.finalize(storage, self._free, id(storage), storage.nbytes())
        return out


def peak_forward_backward(fn, n, v, **kw):
    hidden, weight, _, targets, upstream = inputs(n, h=64, v=v, device="meta")
    with LiveBytes(hidden, weight, targets, upstream) as tracker:
        logp, _ = fn(hidden, weight, targets, 1.0, **kw)
        (logp * upstream).sum().backward()
        del logp
    return tracker.peak


@pytest.mark.parametrize("with_entropy", [False, True])
def test_peak_memory_is_a_quarter_of_the_full_computation(with_entropy):
    n, v = 2048, QWEN25_VOCAB  # measured: 3.5 / 4.6 GiB full, 0.29 / 0.50 GiB chunked (without / with entropy)
    full = peak_forward_backward(full_logprobs, n, v, with_entropy=with_entropy)
    chunked = peak_forward_backward(chunked_logprobs, n, v, with_entropy=with_entropy,
                                    chunk_tokens=chunk_tokens_for(v))
    chunk_logits_bytes = chunk_tokens_for(v) * v * 4
    assert full >= 2 * n * v * 4  # the logits and their log-softmax, at least, are alive together
    assert chunked <= full / 4, (chunked, full)
    assert chunked < 3 * chunk_logits_bytes, (chunked, chunk_logits_bytes)  # one chunk (+ its softmax) at a time
