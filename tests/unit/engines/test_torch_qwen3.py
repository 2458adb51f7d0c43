"""Qwen3 in the torch engine (per-head q/k RMSNorm before RoPE): token for token equal to transformers'
Qwen3ForCausalLM on a tiny random config built here, with the same behaviour logprobs, through prefill, decode,
chunked prefill and an in-place weight update."""
from __future__ import annotations

import pytest
import torch

from areal_mq.engines.base import EngineRequest
from areal_mq.messages import SamplingSpec

from .engine_refs import full_logprobs, greedy_continue, perturbed_state
from .test_torch_engine import run_all

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory, tiny_tokenizer):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(vocab_size=len(tiny_tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32,  # head_dim != hidden / heads
                         max_position_embeddings=512, rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=True,
                         bos_token_id=1, eos_token_id=2, pad_token_id=2)
    torch.manual_seed(3)
    model = Qwen3ForCausalLM(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:  # non-trivial q/k norms, so a missing norm changes the tokens
                param.copy_(1.0 + 0.5 * torch.randn(param.shape))
            else:
                param.normal_(0.0, 0.1)
    out = tmp_path_factory.mktemp("qwen3")
    model.save_pretrained(out)
    tiny_tokenizer.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def hf_qwen3(qwen3_dir):
    from areal_mq.engines.models import load_causal_lm

    model = load_causal_lm(qwen3_dir)
    assert type(model).__name__ == "Qwen3ForCausalLM" and model.model.layers[0].self_attn.q_norm is not None
    return model


def make_qwen3(qwen3_dir, tokenizer, **overrides):
    from areal_mq.engines.config import EngineConfig
    from areal_mq.engines.torch.engine import TorchEngine

    return TorchEngine(qwen3_dir, EngineConfig(**{"seed": 0, "threads": 1, **overrides}), tokenizer=tokenizer)


@pytest.mark.parametrize("chunk", [512, 5])
def test_qwen3_greedy_equals_transformers(qwen3_dir, hf_qwen3, tiny_tokenizer, prompts, chunk):
    engine = make_qwen3(qwen3_dir, tiny_tokenizer, max_concurrent=3, prefill_chunk_tokens=chunk)
    for i, p in enumerate(prompts):
        engine.submit(EngineRequest(f"q{i}", p, SamplingSpec(temperature=0, max_new_tokens=12, ignore_eos=True)))
    outs = run_all(engine)
    for i, p in enumerate(prompts):
        ref = hf_qwen3.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                max_new_tokens=12, do_sample=False, min_new_tokens=12)[0, len(p):].tolist()
        assert outs[f"q{i}"].output_ids.tolist() == ref
        torch.testing.assert_close(torch.from_numpy(outs[f"q{i}"].logprobs), full_logprobs(hf_qwen3, p, ref),
                                   atol=2e-4, rtol=1e-4)


def test_qwen3_sampled_logprobs_and_update(qwen3_dir, hf_qwen3, tiny_tokenizer, prompts):
    import copy

    engine = make_qwen3(qwen3_dir, tiny_tokenizer)
    engine.submit(EngineRequest("s", prompts[1], SamplingSpec(temperature=0.8, top_k=20, max_new_tokens=10,
                                                               ignore_eos=True, seed=4)))
    out = run_all(engine)["s"]
    ref = full_logprobs(hf_qwen3, prompts[1], out.output_ids.tolist(), 0.8)
    torch.testing.assert_close(torch.from_numpy(out.logprobs), ref, atol=2e-4, rtol=1e-4)
    state = perturbed_state(hf_qwen3, seed=8)  # q/k norms included: they must be updated in place too
    engine.update_weights(1, tensors=state)
    new = copy.deepcopy(hf_qwen3)
    new.load_state_dict(state, strict=False)
    engine.submit(EngineRequest("g", prompts[2], SamplingSpec(temperature=0, max_new_tokens=8, ignore_eos=True)))
    got = run_all(engine)["g"]
    assert got.output_ids.tolist() == greedy_continue(new, prompts[2], 8) and set(got.versions.tolist()) == {1}
