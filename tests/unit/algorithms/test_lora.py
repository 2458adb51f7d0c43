"""algorithms/lora.py on tiny random Llama and Qwen2 models: dtypes, the reference, merge, hostile adapters."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("peft")

from pydantic import ValidationError  # noqa: E402

from areal_mq.algorithms import lora  # noqa: E402


def tiny(kind: str):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    common = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2)
    if kind == "llama":
        return LlamaForCausalLM(LlamaConfig(**common))
    return Qwen2ForCausalLM(Qwen2Config(**common))


def perturb(model) -> None:
    """B starts at zero (the adapter is the identity); give it values so merges and references differ."""
    g = torch.Generator().manual_seed(1)
    for name, p in model.named_parameters():
        if "lora_B" in name:
            p.data = torch.randn(p.shape, generator=g) * 0.05


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_attach_freezes_base_in_its_dtype_and_trains_fp32_adapter(kind):
    model = lora.attach(tiny(kind), lora.LoraConfig(rank=4, alpha=8), torch.bfloat16)
    train = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    frozen = [p for p in model.parameters() if not p.requires_grad]
    assert train and all("lora_" in n and p.dtype == torch.float32 for n, p in train)
    assert frozen and all(p.dtype == torch.bfloat16 for p in frozen)
    names = set(lora.adapter_tensors(model))
    # all-linear: every projection of every decoder layer, not the head
    assert {f"model.layers.{i}.{m}.lora_{h}.weight" for i in range(2) for h in "AB"
            for m in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                      "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")} == names


def test_a_seeded_adapter_is_the_same_built_whole_or_on_meta_and_buffers_stay_fp32():
    """What fsdp's sharded loading relies on (algorithms/fsdp.py build): the start adapter is a function of names,
    shapes and seed (not of the device or the global RNG), and every wrapped base name maps to the base's own."""
    cfg = lora.LoraConfig(rank=4, alpha=8)
    whole = lora.attach(tiny("llama"), cfg, torch.bfloat16, seed=3)
    with torch.device("meta"):
        on_meta = lora.attach(tiny("llama"), cfg, torch.bfloat16, seed=3)
    start = lora.initial_adapter(on_meta, 3)
    got = {n: p for n, p in whole.get_base_model().named_parameters() if p.requires_grad}
    assert set(start) == set(got) and all(torch.equal(got[n], start[n]) for n in start)
    assert any(t.abs().sum() > 0 for n, t in start.items() if ".lora_A." in n)
    assert all(not t.any() for n, t in start.items() if ".lora_B." in n)  # B = 0: the policy starts as the base
    assert not torch.equal(lora.initial_adapter(on_meta, 4)[next(iter(start))], next(iter(start.values())))
    plain = set(tiny("llama").state_dict())
    assert {lora.base_name(n) for n, p in whole.get_base_model().named_parameters() if not p.requires_grad} <= plain
    assert all(b.dtype == torch.float32 for b in whole.buffers())  # rotary frequencies as the engines keep them


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_reference_is_the_base_and_merge_matches_peft(kind):
    base = tiny(kind)
    base_logits_model = tiny(kind).eval()  # same seed: the same weights
    model = lora.attach(base, lora.LoraConfig(rank=4, alpha=8, target_modules=["q_proj", "v_proj", "down_proj"]),
                        torch.float32)
    perturb(model)
    model.eval()
    ids = torch.randint(0, 96, (2, 7), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = base_logits_model(ids).logits
        with lora.reference(model):
            ref = model(ids).logits
        adapted = model(ids).logits
    assert torch.equal(ref, want)
    assert (adapted - want).abs().max() > 1e-4
    base_sd = {k: v for k, v in base_logits_model.state_dict().items()}
    merged = lora.merge(base_sd, lora.adapter_tensors(model), 8 / 4)
    assert set(merged) == {f"model.layers.{i}.{m}.weight" for i in range(2)
                           for m in ("self_attn.q_proj", "self_attn.v_proj", "mlp.down_proj")}
    peft_merged = model.merge_and_unload().state_dict()
    for k, v in merged.items():
        torch.testing.assert_close(v, peft_merged[k], rtol=0, atol=1e-6)


def test_merge_rounds_once_from_the_base():
    w = torch.randn(8, 6).to(torch.bfloat16)
    a, b = torch.randn(2, 6), torch.randn(8, 2)
    got = lora.merge({"m.weight": w}, {"m.lora_A.weight": a, "m.lora_B.weight": b}, 0.5)["m.weight"]
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, (w.float() + 0.5 * (b @ a)).to(torch.bfloat16))


@pytest.mark.parametrize("adapter,match", [
    ({"m.lora_A.weight": torch.zeros(2, 6)}, "needs both"),
    ({"x.lora_A.weight": torch.zeros(2, 6), "x.lora_B.weight": torch.zeros(8, 2)}, "not a linear"),
    ({"m.lora_A.weight": torch.zeros(2, 6), "m.lora_B.weight": torch.zeros(8, 3)}, "rank"),
    ({"m.lora_A.weight": torch.zeros(2, 5), "m.lora_B.weight": torch.zeros(8, 2)}, "B @ A"),
    ({"m.lora_A.weight": torch.zeros(2, 6), "m.lora_B.weight": torch.zeros(8, 2), "m.weight": torch.zeros(8, 6)},
     "not named"),
    ({"../../etc.lora_A.weight": torch.zeros(2, 6)}, "not named"),
])
def test_hostile_adapters_are_refused(adapter, match):
    with pytest.raises(lora.AdapterError, match=match):
        lora.merge({"m.weight": torch.zeros(8, 6)}, adapter, 1.0)


def test_rank_bound():
    big = {"m.lora_A.weight": torch.zeros(5, 6), "m.lora_B.weight": torch.zeros(8, 5)}
    with pytest.raises(lora.AdapterError, match="exceeds 4"):
        lora.check_adapter(big, {"m.weight": (8, 6)}, max_rank=4)


def test_config_is_checked():
    cfg = lora.LoraConfig()
    assert (cfg.rank, cfg.alpha, cfg.scaling, cfg.target_modules) == (16, 32.0, 2.0, "all-linear")
    for bad in ({"rank": 0}, {"target_modules": ["q_proj; import os"]}, {"target_modules": []}, {"typo": 1}):
        with pytest.raises(ValidationError):
            lora.LoraConfig(**bad)


def test_load_adapter_round_trip():
    cfg = lora.LoraConfig(rank=4, alpha=8)
    a = lora.attach(tiny("llama"), cfg, torch.float32)
    perturb(a)
    b = lora.attach(tiny("llama"), cfg, torch.float32)
    lora.load_adapter(b, lora.adapter_tensors(a))
    for k, v in lora.adapter_tensors(a).items():
        assert torch.equal(lora.adapter_tensors(b)[k], v)
