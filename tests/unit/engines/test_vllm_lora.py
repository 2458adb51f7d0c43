"""engine: vllm's LoRA pieces that need no vLLM (areal_mq/engines/vllm/lora.py, config.configure): the rank vLLM is
started with, the run's config check, the PEFT directory an adapter version becomes, what is refused before anything
is written, and which directories are kept while requests use them."""
from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")

from areal_mq.config import load_config  # noqa: E402
from areal_mq.engines.vllm.lora import (ADAPTER_FILE, CONFIG_FILE, PEFT_PREFIX, AdapterSlot, adapter_name,  # noqa: E402
                                        lora_args, vllm_rank)
from areal_mq.errors import ConfigError, WeightsLoadError  # noqa: E402

SHAPES = {"model.layers.0.self_attn.q_proj.weight": (8, 6), "model.layers.0.mlp.down_proj.weight": (6, 10),
          "model.embed_tokens.weight": (32, 6), "model.norm.weight": (6,)}
TARGETS = frozenset({"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"})


def adapter(rank=2, modules=("model.layers.0.self_attn.q_proj", "model.layers.0.mlp.down_proj")):
    g = torch.Generator().manual_seed(rank)
    out = {}
    for m in modules:
        rows, cols = SHAPES[m + ".weight"]
        out[m + ".lora_A.weight"] = torch.randn(rank, cols, generator=g)
        out[m + ".lora_B.weight"] = torch.randn(rows, rank, generator=g)
    return out


def slot(tmp_path, max_rank=4):
    s = AdapterSlot(tmp_path / "lora", max_rank, SHAPES)
    s.targets = TARGETS
    return s


def test_vllm_is_started_with_the_next_rank_it_accepts():
    assert [vllm_rank(r) for r in (1, 2, 8, 9, 16, 300, 512)] == [1, 8, 8, 16, 16, 320, 512]
    with pytest.raises(ConfigError, match="above 512"):
        vllm_rank(513)
    assert lora_args(12) == {"enable_lora": True, "max_loras": 1, "max_cpu_loras": 1, "max_lora_rank": 16}
    assert adapter_name(7) == "areal-v7"


def test_the_runs_config_check_turns_lora_on_for_engine_vllm(tmp_path):
    cfg = load_config(None, [f"run.run_dir={tmp_path}", "rollout.engine.kind=vllm", "trainer.lora.rank=12"])
    assert cfg.rollout.engine.vllm.max_lora_rank == 12
    assert cfg.rollout.engine.vllm.lora_dir == str(tmp_path / "vllm-lora")
    plain = load_config(None, [f"run.run_dir={tmp_path}", "rollout.engine.kind=vllm"])
    assert plain.rollout.engine.vllm.max_lora_rank is None
    with pytest.raises((ConfigError, ValueError), match="vllm-server"):
        load_config(None, [f"run.run_dir={tmp_path}", "rollout.engine.kind=vllm-server", "trainer.lora.rank=8"])


def test_an_adapter_version_becomes_a_peft_directory(tmp_path):
    from safetensors.torch import load_file

    s = slot(tmp_path)
    tensors = adapter(rank=2)
    staged = s.stage(tensors, scaling=8.0, max_rank=2)
    assert (staged.rank, staged.modules) == (2, 2)
    saved = load_file(f"{staged.path}/{ADAPTER_FILE}")
    assert set(saved) == {PEFT_PREFIX + k for k in tensors}
    assert all(torch.equal(saved[PEFT_PREFIX + k], v) for k, v in tensors.items())
    config = json.loads(open(f"{staged.path}/{CONFIG_FILE}").read())
    assert config["r"] == 2 and config["lora_alpha"] / config["r"] == 8.0  # vLLM's scaling is alpha / r
    assert sorted(config["target_modules"]) == ["down_proj", "q_proj"] and config["bias"] == "none"
    assert str(tmp_path / "lora") in staged.path


@pytest.mark.parametrize("case, match", [
    ("rank over the engine's", "exceeds 4"), ("rank over the announced", "exceeds 2"),
    ("embedding", "serves no LoRA"), ("not a linear", "not a linear"), ("a path", "not named"),
])
def test_what_vllm_cannot_serve_is_refused_before_anything_is_written(tmp_path, case, match):
    s = slot(tmp_path)
    announced = None
    if case == "rank over the engine's":
        tensors = adapter(rank=5)
    elif case == "rank over the announced":
        tensors, announced = adapter(rank=3), 2
    elif case == "embedding":  # a 2-D weight, so the generic check passes; vLLM has no linear LoRA there
        tensors = {"model.embed_tokens.lora_A.weight": torch.zeros(2, 6),
                   "model.embed_tokens.lora_B.weight": torch.zeros(32, 2)}
    elif case == "not a linear":
        tensors = {"model.norm.lora_A.weight": torch.zeros(2, 6), "model.norm.lora_B.weight": torch.zeros(6, 2)}
    else:
        tensors = {"../../etc.lora_A.weight": torch.zeros(2, 6)}
    with pytest.raises(WeightsLoadError, match=match):
        s.stage(tensors, 1.0, announced)
    assert s.dirs() == []


def test_a_superseded_version_is_deleted_once_no_request_holds_it(tmp_path):
    s = slot(tmp_path)
    zero = s.zero(TARGETS)
    s.swapped(zero)
    s.hold(zero.path)  # a request running on the base
    v1 = s.stage(adapter(), 1.0)
    s.swapped(v1)
    assert [str(d) for d in s.dirs()] == [zero.path, v1.path]  # still held
    v2 = s.stage(adapter(), 1.0)  # staged, not yet served: kept whatever is released meanwhile
    s.release(zero.path)
    assert [str(d) for d in s.dirs()] == [v1.path, v2.path]
    s.swapped(v2)
    assert [str(d) for d in s.dirs()] == [v2.path]
    v3 = s.stage(adapter(), 1.0)
    s.discard(v3)  # vLLM refused it
    assert [str(d) for d in s.dirs()] == [v2.path]
    s.close()
    assert not s.root.exists()


def test_the_zero_adapter_is_exactly_the_base(tmp_path):
    from safetensors.torch import load_file

    zero = slot(tmp_path).zero(TARGETS)
    saved = load_file(f"{zero.path}/{ADAPTER_FILE}")
    assert len(saved) == 2 and all(not t.any() for t in saved.values())
