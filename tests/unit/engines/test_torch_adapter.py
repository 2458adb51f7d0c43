"""LoRA adapter versions in the TorchEngine (engines/torch/adapter.py): merged from the kept base mid-generation,
exactly a full update of the merged weights, versions per token exact, bad adapters refused with nothing changed."""
from __future__ import annotations

import pytest
import torch

from areal_mq.errors import WeightsLoadError
from areal_mq.weights.adapter import merge

from .engine_refs import greedy_continue, model_with
from .test_torch_engine import greedy
from .test_torch_engine_updates import AFTER, BEFORE, engine_for, generate_with_update

pytestmark = pytest.mark.timeout(180)
MODULES = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
           "mlp.up_proj", "mlp.down_proj")


def random_adapter(model, seed: int, rank: int = 4, scale: float = 0.3) -> dict[str, torch.Tensor]:
    """An all-linear adapter for `model` (A [rank, in], B [out, rank]), seeded."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, p in model.named_parameters():
        module = name.removesuffix(".weight")
        if name.endswith(".weight") and module.split(".", 3)[-1] in MODULES:
            out[module + ".lora_A.weight"] = torch.randn(rank, p.shape[1], generator=g) * scale
            out[module + ".lora_B.weight"] = torch.randn(p.shape[0], rank, generator=g) * scale
    return out


def test_adapter_mid_generation_equals_the_merged_full_update(make_engine, hf_tiny, prompts):
    base = {k: v.detach().clone() for k, v in hf_tiny.state_dict().items()}
    adapter = random_adapter(hf_tiny, seed=5)
    merged = {**base, **merge(base, adapter, 2.0)}
    sampling = greedy(BEFORE + AFTER, ignore_eos=True)

    full = engine_for(make_engine, kv_on_update="recompute")
    want, _ = generate_with_update(full, prompts, sampling, tensors=merged)
    lora = engine_for(make_engine, kv_on_update="recompute")
    staged = lora.stage_adapter(adapter, 2.0)
    assert len(staged) == 2 * 7  # 2 layers x 7 linears
    got, timings = generate_with_update(lora, prompts, sampling, adapter=staged)
    for rid, out in want.items():
        assert got[rid].output_ids.tolist() == out.output_ids.tolist()
        assert got[rid].versions.tolist() == [0] * BEFORE + [1] * AFTER
    assert timings["tensors"] == 14.0
    # and the merged weights are HF's: greedy tokens of an independent HF model holding them
    hf_merged = model_with(hf_tiny, merged)
    for i, p in enumerate(prompts):
        tokens = got[f"u{i}"].output_ids.tolist()
        assert tokens[BEFORE:] == greedy_continue(hf_merged, p + tokens[:BEFORE], AFTER)


def test_each_version_merges_from_the_base_not_the_previous_version(make_engine, hf_tiny):
    engine = make_engine()
    name = "model.layers.0.self_attn.q_proj.weight"
    before = dict(engine.model.named_parameters())[name].detach().clone()
    a1, a2 = random_adapter(hf_tiny, seed=1), random_adapter(hf_tiny, seed=2)
    engine.update_weights(1, adapter=engine.stage_adapter(a1, 1.0))
    engine.update_weights(2, adapter=engine.stage_adapter(a2, 1.0))
    want = merge({name: before}, {k: v for k, v in a2.items() if k.startswith(name[:-len(".weight")])}, 1.0)[name]
    assert torch.equal(dict(engine.model.named_parameters())[name], want)
    # a zero adapter gives the base back exactly
    zero = {k: torch.zeros_like(v) for k, v in a2.items()}
    engine.update_weights(3, adapter=engine.stage_adapter(zero, 1.0))
    assert torch.equal(dict(engine.model.named_parameters())[name], before)


@pytest.mark.parametrize("bad", ["shape", "name", "half"])
def test_bad_adapter_is_refused_and_changes_nothing(make_engine, hf_tiny, bad):
    engine = make_engine()
    adapter = random_adapter(hf_tiny, seed=3)
    key = "model.layers.1.mlp.up_proj.lora_B.weight"
    if bad == "shape":
        adapter[key] = torch.zeros(adapter[key].shape[0] + 1, adapter[key].shape[1])
    elif bad == "name":
        adapter["model.embed_tokens.lora_A.weight"] = torch.zeros(4, 8)
        adapter["model.embed_tokens.lora_B.weight"] = torch.zeros(8, 4)
    else:
        del adapter[key]
    snapshot = {k: v.detach().clone() for k, v in engine.model.named_parameters()}
    with pytest.raises(WeightsLoadError):
        engine.stage_adapter(adapter, 1.0)
    assert all(torch.equal(v, snapshot[k]) for k, v in engine.model.named_parameters())


def test_an_adapter_above_its_announced_rank_is_refused(make_engine, hf_tiny):
    engine = make_engine()
    with pytest.raises(WeightsLoadError, match="exceeds 2"):
        engine.stage_adapter(random_adapter(hf_tiny, seed=4, rank=4), 1.0, max_rank=2)
