"""Model shapes from their public configs, built locally with seeded random weights (nothing is downloaded).

What: `SHAPES` holds the architecture fields of the model sizes users train (Qwen2.5 0.5B-72B, Qwen3 4B/8B,
Llama 3.2 1B), copied from each model's public config.json; `TINY` holds 2-layer versions of each family (Llama,
Qwen2 with q/k/v biases, Qwen3 with q/k norms) for the sharded-trainer tests. `build_random_model(dst, name)`
writes config.json + model.safetensors with weights from one seeded generator, and reuses a directory already
built with the same settings. `parameter_count(name)` counts parameters from the config without building.
Why: memory, speed and parity do not depend on what the weights are, and the test and benchmark machines cannot
download 1-15 GB checkpoints.

    python -m areal_mq.engines.shapes DST qwen2.5-0.5b
"""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

_QWEN25 = dict(model_type="qwen2", hidden_act="silu", max_position_embeddings=32768, rope_theta=1000000.0,
               rms_norm_eps=1e-6, bos_token_id=151643, eos_token_id=151645)
_QWEN3 = dict(model_type="qwen3", hidden_act="silu", max_position_embeddings=40960, rope_theta=1000000.0,
              rms_norm_eps=1e-6, head_dim=128, bos_token_id=151643, eos_token_id=151645, attention_bias=False)
SHAPES: dict[str, dict[str, Any]] = {
    "qwen2.5-0.5b": dict(_QWEN25, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "qwen2.5-1.5b": dict(_QWEN25, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                         num_attention_heads=12, num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "qwen2.5-3b": dict(_QWEN25, hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
                       num_attention_heads=16, num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "qwen2.5-7b": dict(_QWEN25, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                       num_attention_heads=28, num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False),
    "qwen2.5-14b": dict(_QWEN25, hidden_size=5120, intermediate_size=13824, num_hidden_layers=48,
                        num_attention_heads=40, num_key_value_heads=8, vocab_size=152064, tie_word_embeddings=False),
    "qwen2.5-32b": dict(_QWEN25, hidden_size=5120, intermediate_size=27648, num_hidden_layers=64,
                        num_attention_heads=40, num_key_value_heads=8, vocab_size=152064, tie_word_embeddings=False),
    "qwen2.5-72b": dict(_QWEN25, hidden_size=8192, intermediate_size=29568, num_hidden_layers=80,
                        num_attention_heads=64, num_key_value_heads=8, vocab_size=152064, tie_word_embeddings=False),
    "qwen3-4b": dict(_QWEN3, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, vocab_size=151936, tie_word_embeddings=True),
    "qwen3-8b": dict(_QWEN3, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, vocab_size=151936, tie_word_embeddings=False),
    "llama-3.2-1b": dict(model_type="llama", hidden_act="silu", hidden_size=2048, intermediate_size=8192,
                         num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                         vocab_size=128256, max_position_embeddings=131072, rope_theta=500000.0, rms_norm_eps=1e-5,
                         tie_word_embeddings=True, bos_token_id=128000, eos_token_id=128009),
}
_TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, vocab_size=49152, max_position_embeddings=2048, pad_token_id=2, bos_token_id=1,
             eos_token_id=2)
TINY: dict[str, dict[str, Any]] = {  # one per family the sharded trainer supports (tests)
    "tiny-llama": dict(_TINY, model_type="llama", tie_word_embeddings=True, rms_norm_eps=1e-5),
    "tiny-qwen2": dict(_TINY, model_type="qwen2", tie_word_embeddings=False, rms_norm_eps=1e-6),  # q/k/v biases
    "tiny-qwen3": dict(_TINY, model_type="qwen3", tie_word_embeddings=True, rms_norm_eps=1e-6),  # q/k norms
}
MARK = ".random-model.json"


def shape(name: str, **overrides: Any) -> dict[str, Any]:
    table = {**SHAPES, **TINY}
    if name not in table:
        raise KeyError(f"unknown model shape {name!r}; known: {', '.join(table)}")
    return {**table[name], **overrides}


def hf_config(name: str, **overrides: Any) -> Any:
    from transformers import AutoConfig

    fields = shape(name, **overrides)
    return AutoConfig.for_model(fields.pop("model_type"), **fields)


def parameter_count(name: str, **overrides: Any) -> int:
    """Parameters of the shape, counted from its config (`count_parameters`; the meta device where it cannot)."""
    counted = count_parameters(shape(name, **overrides))
    if counted is not None:
        return counted[0]
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config(name, **overrides))
    return sum(p.numel() for p in model.parameters())


# The decoder families whose parameters are counted from config.json alone: their modules and transformers'
# defaults for the fields a config may leave out (head_dim: hidden / heads, except Qwen3's 128).
_COUNTED = {"llama": dict(head_dim=None), "mistral": dict(head_dim=None), "qwen2": dict(head_dim=None),
            "qwen3": dict(head_dim=128)}
_NEEDED = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
           "vocab_size", "tie_word_embeddings")  # absent ones take per-family defaults (Qwen2's kv heads 32, Mistral's 8)


def head_dim_of(config: dict[str, Any]) -> int:
    """A config.json's head dimension: its head_dim, else the family's default (Qwen3: 128; others hidden / heads)."""
    default = _COUNTED.get(config.get("model_type"), {}).get("head_dim")
    return config.get("head_dim") or default or config["hidden_size"] // config["num_attention_heads"]


def count_parameters(config: dict[str, Any]) -> tuple[int, int] | None:
    """(parameters of the model, parameters of one decoder layer) from a config.json's fields, without torch or
    transformers (a launcher that imports both to count spends seconds of CPU beside the children it starts:
    issue 58); None for a family not in _COUNTED or a config without the fields (the caller counts on the meta
    device). Llama / Mistral: q, k, v, o (biases with attention_bias), gate, up, down (biases with mlp_bias), two
    norms; Qwen2: biases on q, k and v only; Qwen3: q/k norms of head_dim (attention_bias for q, k, v, o).
    Equal to the meta-device count for every shape in SHAPES and TINY: tests/unit/engines/test_shapes_count.py."""
    family = config.get("model_type")
    if family not in _COUNTED or any(config.get(k) is None for k in _NEEDED):
        return None
    h, i, heads = config["hidden_size"], config["intermediate_size"], config["num_attention_heads"]
    kv = config["num_key_value_heads"]
    d = head_dim_of(config)
    q, k = heads * d, kv * d
    if family == "qwen2":
        attn = (h * q + q) + 2 * (h * k + k) + q * h
    else:
        bias = bool(config.get("attention_bias", False))
        attn = h * q + 2 * h * k + q * h + ((q + 2 * k + h) if bias else 0)
    mlp = 3 * h * i + ((2 * i + h) if family in ("llama", "mistral") and config.get("mlp_bias", False) else 0)
    layer = attn + mlp + 2 * h + (2 * d if family == "qwen3" else 0)
    vocab = config["vocab_size"]
    total = vocab * h + config["num_hidden_layers"] * layer + h + (0 if config["tie_word_embeddings"] else vocab * h)
    return total, layer


def build_random_model(dst: str | Path, name: str, seed: int = 0, *, dtype: str = "float32", device: str = "cpu",
                       **overrides: Any) -> Path:
    """config.json + model.safetensors of shape `name` with seeded random weights (std 0.02, norms 1) in `dst`,
    saved in `dtype`; drawn on `device` (a GPU draws a 4B model in a second; the numbers differ per device)."""
    dst = Path(dst)
    want = {"name": name, "seed": seed, "dtype": dtype, "device": device, "overrides": overrides}
    if _built_as(dst, want):
        return dst
    # two processes asking for the same directory at once (two rehearsals, parallel tests) must not write one
    # file together, nor may one load a half-written model; an earlier draw is replaced, anything else is kept
    from areal_mq.engines.models import build_once

    def draw(tmp: Path) -> None:
        _draw(tmp, name, seed, dtype, device, overrides)
        (tmp / MARK).write_text(json.dumps(want))

    return build_once(dst, lambda d: _built_as(d, want), draw,
                      replace=lambda d: (d / MARK).is_file() or not any(d.iterdir()))


def _built_as(dst: Path, want: dict) -> bool:
    try:
        return json.loads((dst / MARK).read_text()) == want
    except (OSError, ValueError):
        return False


def _draw(dst: Path, name: str, seed: int, dtype: str, device: str, overrides: dict) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    config = hf_config(name, **overrides)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for pname, param in sorted(model.named_parameters()):
            if pname.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.normal_(0.0, 0.02 if name in SHAPES else 0.1, generator=gen)
    model.save_pretrained(str(dst), safe_serialization=True)
    _copy_tokenizer(dst)


def _copy_tokenizer(dst: Path) -> None:
    """SmolLM2's tokenizer files (from the offline model cache), so the directory loads like any model dir. Its
    49,152 ids are a subset of every shape's vocabulary; only decoding text would notice the difference."""
    import shutil

    from areal_mq.engines.models import TOKENIZER_COPY, resolve_model

    src = resolve_model("tiny-random-llama")
    for name in TOKENIZER_COPY:
        if (src / name).is_file():
            shutil.copy2(src / name, dst / name)


if __name__ == "__main__":
    print(build_random_model(sys.argv[1], sys.argv[2]))
