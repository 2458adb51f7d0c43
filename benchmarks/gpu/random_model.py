"""A model directory of SmolLM2-135M's exact config with random weights, for the GPU speed stages (b, c, d).

What: `build(dst, quick, source)` writes config.json, model.safetensors (random init, seed 0) and the
tokenizer files into `dst` and returns it; a directory already built with the same settings is reused.
`quick` shrinks the config (2 layers, hidden 64) so the CPU smoke run takes seconds through the same code.
Why random weights: the real weights (a 92 MB GGUF) do not fit the 64 MiB one GPU command carries, and a
forward pass costs the same whatever the numbers in the matrices are; speed stages ignore EOS
(`ignore_eos` / `min_new_tokens`), so the answers' lengths are fixed too. Stages that learn (e, f) need the
real weights (docs/gpu.md).
Where the config comes from: `source` (gpu_pack/smollm2, written by pack.sh) when it exists, else the
converted SmolLM2 here (areal_mq.engines.models.resolve_model).

    python benchmarks/gpu/random_model.py DST [--quick] [--source gpu_pack/smollm2]
"""
from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

NAME = "smollm2-135m"  # the config measured; the timing slot is named after it (fit_sim.py)
QUICK_SHAPE = {"num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
               "num_key_value_heads": 2, "head_dim": 16}
MARK = ".random-model.json"


def source_dir(source: str | Path | None) -> Path:
    """gpu_pack/smollm2 when given and present, else the SmolLM2 model directory resolved here."""
    if source and (Path(source) / "config.json").is_file():
        return Path(source)
    from areal_mq.engines.models import resolve_model

    return resolve_model("smollm2-135m-instruct")


def build(dst: str | Path, quick: bool = False, source: str | Path | None = None) -> Path:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from areal_mq.engines.models import TOKENIZER_FILES

    dst, src = Path(dst), source_dir(source)
    want = {"name": NAME, "quick": quick, "seed": 0}
    if (dst / MARK).is_file() and json.loads((dst / MARK).read_text()) == want:
        return dst
    config = AutoConfig.from_pretrained(src, local_files_only=True)
    if quick:
        for key, value in QUICK_SHAPE.items():
            setattr(config, key, value)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    shutil.rmtree(dst, ignore_errors=True)
    model.save_pretrained(dst, safe_serialization=True)
    for name in (*TOKENIZER_FILES, "special_tokens_map.json", "chat_template.jinja"):
        if (src / name).is_file():
            shutil.copy2(src / name, dst / name)
    (dst / MARK).write_text(json.dumps(want))
    return dst


def describe(model_dir: Path, quick: bool) -> dict:
    """What was measured: the config's shape, for the JSON (and the timing slot's name)."""
    c = json.loads((model_dir / "config.json").read_text())
    heads = c["num_attention_heads"]
    head_dim = c.get("head_dim") or c["hidden_size"] // heads
    return {"name": NAME + ("-quick-shape" if quick else ""), "weights": "random (seed 0), SmolLM2's exact config"
            + (" shrunk for the CPU smoke run" if quick else ""), "layers": c["num_hidden_layers"],
            "hidden": c["hidden_size"], "heads": heads, "kv_heads": c.get("num_key_value_heads", heads),
            "head_dim": head_dim, "vocab": c["vocab_size"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dst", type=Path)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--source", type=Path, default=None)
    args = parser.parse_args()
    print(build(args.dst, args.quick, args.source))


if __name__ == "__main__":
    main()
