"""engine: vllm serving LoRA versions (trainer.lora) through vLLM's LoRA API, against real vLLM (CPU) and an
independent Hugging Face forward pass of the base with the adapter merged (W + alpha/rank * B @ A, in float32).

One engine (float32, SmolLM2-135M, LoRA slot of rank 8) is shared by the module: each vLLM start costs minutes here.
Checks: the slot starts with a zero adapter, exactly the base; an adapter version swapped in mid-generation stamps the
tokens before with the old version and after with the new one (vLLM's spans agree with the engine's own stamps), the
tokens before follow the old adapter and the ones after the new one, its KV recomputed ("recompute") or kept
("keep"), each against its HF reference; vLLM holds one adapter, named areal-v<version>, and the superseded version's
directory is gone once no request uses it; a rank over the engine's, a target vLLM cannot serve, an adapter vLLM
itself refuses and a full version are each a WeightsLoadError, and the previous version goes on being served.

Run: pytest -m vllm tests/integration/test_vllm_lora.py  (needs bash docker/install-vllm.sh)
"""
from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("vllm", reason="vLLM not installed: bash docker/install-vllm.sh")

import torch  # noqa: E402

from areal_mq.engines.config import EngineConfig  # noqa: E402
from areal_mq.engines.models import resolve_model  # noqa: E402
from areal_mq.engines.vllm.engine import VllmEngine  # noqa: E402
from areal_mq.errors import WeightsLoadError  # noqa: E402
from areal_mq.weights.adapter import merge  # noqa: E402

from .test_vllm_engine import ARGMAX_TOL, LOGPROB_TOL, PROMPT, greedy, run  # noqa: E402
from .vllm_reference import HFReference  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(1800)]

RANK, ALPHA = 8, 16.0
SCALING = ALPHA / RANK
MODULES = ("q_proj", "v_proj", "down_proj")


@pytest.fixture(scope="module")
def model_dir():
    return resolve_model("smollm2-135m-instruct")


@pytest.fixture(scope="module")
def base(model_dir):
    from safetensors.torch import load_file

    return load_file(str(model_dir / "model.safetensors"))


@pytest.fixture(scope="module")
def hf(model_dir):
    return HFReference(model_dir)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("run")


@pytest.fixture(scope="module")
def engine(model_dir, run_dir):
    cfg = EngineConfig(kind="vllm", max_concurrent=4, seed=0,
                       vllm={"kv_cache_space_gib": 1, "start_timeout_s": 1200, "max_lora_rank": RANK,
                             "lora_dir": str(run_dir / "vllm-lora"), "enforce_eager": True})  # see test_vllm_engine.py
    eng = VllmEngine(cfg, model_dir)
    print(f"\nvLLM engine with LoRA started in {eng.start_s:.1f} s")
    yield eng
    eng.close()


def make_adapter(base, seed, rank=RANK, modules=MODULES, scale=0.1):
    """A seeded adapter whose update B @ A * scaling is about `scale` x each weight's std (a visible change)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, w in base.items():
        module = name.removesuffix(".weight")
        if ".layers." in name and module.rsplit(".", 1)[-1] in modules:
            step = (scale * w.float().std().item() / (SCALING * rank ** 0.5)) ** 0.5
            out[module + ".lora_A.weight"] = torch.randn(rank, w.shape[1], generator=g) * step
            out[module + ".lora_B.weight"] = torch.randn(w.shape[0], rank, generator=g) * step
    return out


def merged(base, adapter):
    """The base with the adapter merged in float32 (the checkpoint is bf16: rounding the merged weights to it would
    differ from vLLM's float32 LoRA path by far more than the tolerance)."""
    return {**base, **merge({k: v.float() for k, v in base.items()}, adapter, SCALING)}


def swap_in(engine, version, adapter, **kw):
    return engine.update_weights(version, adapter=engine.stage_adapter(adapter, SCALING, RANK), **kw)


def follows(hf, out, weights):
    lp, best = hf.logprobs(PROMPT, out.output_ids.tolist(), 0.0, weights)
    np.testing.assert_allclose(out.logprobs, lp, atol=LOGPROB_TOL)
    assert (best - lp <= ARGMAX_TOL).all()


def test_the_slot_starts_with_a_zero_adapter_exactly_the_base(engine, hf, base):
    out = run(engine, [greedy("base0")])["base0"]
    assert out.versions.tolist() == [engine.version] * len(out.output_ids)
    assert engine.stats()["adapter"] == f"areal-v{engine.version}"
    follows(hf, out, base)


@pytest.mark.parametrize("mode", ["recompute", "keep"])
def test_a_new_adapter_version_mid_generation_carries_exact_version_tags(engine, hf, base, run_dir, mode):
    v0 = engine.version + 1
    ad1, ad2 = make_adapter(base, 1), make_adapter(base, 2)
    swap_in(engine, v0, ad1)
    timings = {}
    out = run(engine, [greedy("m-" + mode, 64, ignore_eos=True)], on_tokens=(6, lambda e: timings.update(
        swap_in(e, v0 + 1, ad2, kv_on_update=mode))))["m-" + mode]
    k = int((out.versions == v0).sum())
    assert 0 < k < len(out.output_ids), out.versions
    assert out.versions.tolist() == [v0] * k + [v0 + 1] * (len(out.output_ids) - k)
    assert np.array_equal(out.stats["own_versions"], out.versions)  # vLLM's spans == our stamps
    assert engine.stats()["version_mismatches"] == 0
    ids = out.output_ids.tolist()
    w1, w2 = merged(base, ad1), merged(base, ad2)
    lp1, _ = hf.logprobs(PROMPT, ids, 0.0, w1)
    if mode == "recompute":
        lp2, best2 = hf.logprobs(PROMPT, ids, 0.0, w2)
    else:  # the KV of the tokens before the switch stays the old adapter's
        lp2, best2 = hf.logprobs(PROMPT, ids, 0.0, w1, switch_weights=w2, switch_at=k)
    np.testing.assert_allclose(out.logprobs[:k], lp1[:k], atol=LOGPROB_TOL)
    np.testing.assert_allclose(out.logprobs[k:], lp2[k:], atol=LOGPROB_TOL)
    assert (best2[k:] - lp2[k:] <= ARGMAX_TOL).all()
    assert np.abs(lp1[k:] - lp2[k:]).max() > 10 * LOGPROB_TOL  # the two adapters really differ there
    print(f"\n{mode}: adapter swap after {k} tokens, paused {timings['paused_s']:.3f} s, "
          f"total {timings['total_s']:.3f} s")
    # one adapter in vLLM, named after the version; the superseded directories are gone (no request holds them)
    assert engine.loaded_adapters() == [1]
    assert engine.stats()["adapter"] == f"areal-v{v0 + 1}" and engine.stats()["adapter_dirs"] == 1
    assert len(list((run_dir / "vllm-lora").glob("*/a*"))) == 1
    after = run(engine, [greedy("n-" + mode)])["n-" + mode]
    assert after.versions.tolist() == [v0 + 1] * len(after.output_ids)
    follows(hf, after, w2)


def test_bad_adapters_are_refused_and_the_previous_version_is_served(engine, hf, base):
    v = engine.version + 1
    ad = make_adapter(base, 3)
    swap_in(engine, v, ad)
    with pytest.raises(WeightsLoadError, match=f"exceeds {RANK}"):
        engine.stage_adapter(make_adapter(base, 4, rank=16), SCALING, 16)
    embed = {"model.embed_tokens.lora_A.weight": torch.zeros(RANK, base["model.embed_tokens.weight"].shape[1]),
             "model.embed_tokens.lora_B.weight": torch.zeros(base["model.embed_tokens.weight"].shape[0], RANK)}
    with pytest.raises(WeightsLoadError, match="serves no LoRA"):
        engine.stage_adapter(embed, SCALING, RANK)
    # past our checks (written directly): vLLM's own LoRA checks refuse it, before evicting the served adapter
    big = make_adapter(base, 5, rank=16, modules=("q_proj",))
    staged = engine.lora._write(big, 16, SCALING, ["q_proj"], len(big) // 2)
    with pytest.raises(WeightsLoadError, match="max_lora_rank"):
        engine.update_weights(v + 1, adapter=staged)
    with pytest.raises(WeightsLoadError, match="full version"):
        engine.update_weights(v + 1, tensors=base)
    assert engine.version == v and engine.stats()["adapter"] == f"areal-v{v}"
    assert engine.loaded_adapters() == [1] and engine.stats()["adapter_dirs"] == 1
    out = run(engine, [greedy("after-bad")])["after-bad"]
    assert out.versions.tolist() == [v] * len(out.output_ids)
    follows(hf, out, merged(base, ad))
