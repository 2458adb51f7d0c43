"""Export of a LoRA checkpoint (trainer.lora): merged weights streamed from the base, or a PEFT adapter directory.

What: a LoRA checkpoint (algorithms/lora.py `save`) holds PEFT's adapter_model.safetensors + adapter_config.json and
base_model.json ({"path", "sha256"} of the base it was trained on), never the base's weights. Two forms come out:
- merged (`areal-mq checkpoint export CKPT OUT`, export.py): `LoraSource` reads each base tensor from the base
  model directory and, where the module is adapted, returns W + scaling * B @ A in fp32 (weights/adapter.py
  `merge`, the one definition the engines use too); export.py casts it once to the export dtype and appends it to
  the current shard. Memory: the adapter (MBs) plus one base tensor and its fp32 merge; never the whole model.
- adapter (`--adapter`, `export_adapter`): adapter_model.safetensors (the trained fp32 adapter, or `dtype`) and
  adapter_config.json with `base_model_name_or_path` set to the checked base (written by export.export_adapter), so
  `PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), OUT)` or vLLM's LoRA loader takes it.
Both forms first find the base (base_model.json's path, or `base` passed in: `--base DIR`) and check its sha256
(lora.base_identity: one read of the base's weight files); a missing base or another one is refused before
anything is written.

Why: an adapter is meaningless without the exact base it was trained on, and users deploy either merged bf16
weights (any engine) or the small adapter beside a base they already serve.

Tests: tests/unit/algorithms/test_export_lora.py.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from areal_mq.algorithms.lora import ADAPTER_FILE, BASE_FILE, PEFT_PREFIX, base_identity
from areal_mq.errors import ExportError
from areal_mq.weights.adapter import AdapterError, check_adapter, merge, pairs

ADAPTER_CONFIG = "adapter_config.json"


def is_lora(src: Path) -> bool:
    """Whether checkpoint `src` holds a LoRA adapter rather than full weights."""
    return (src / ADAPTER_FILE).is_file() and (src / BASE_FILE).is_file()


def checked_base(src: Path, base: str | Path | None = None) -> Path:
    """The base model directory of LoRA checkpoint `src` (base_model.json's path, or `base`), after checking that
    its sha256 is the one the adapter was trained on."""
    saved = json.loads((src / BASE_FILE).read_text())
    path = Path(base) if base is not None else Path(saved.get("path", ""))
    where = "--base" if base is not None else f"{src / BASE_FILE}"
    if not path.is_dir() or not any(path.glob("*.safetensors")) or not (path / "config.json").is_file():
        raise ExportError(f"the base model of LoRA checkpoint {src} is missing: {path} (from {where}) holds no "
                          "config.json and *.safetensors; pass --base DIR with the model it was trained on")
    got = base_identity(path)["sha256"]
    if saved.get("sha256") and got != saved["sha256"]:
        raise ExportError(f"LoRA checkpoint {src} was trained on the base at {saved.get('path')} (sha256 "
                          f"{saved['sha256']}), but {path} (from {where}) has sha256 {got}: pass --base DIR with "
                          "the model it was trained on")
    return path


def adapter_config(src: Path) -> dict[str, Any]:
    """PEFT's adapter_config.json, refusing what the merge does not reproduce (per-module ranks or alphas, DoRA,
    biases, extra trained modules)."""
    cfg = json.loads((src / ADAPTER_CONFIG).read_text())
    unsupported = {"rank_pattern": cfg.get("rank_pattern"), "alpha_pattern": cfg.get("alpha_pattern"),
                   "use_dora": cfg.get("use_dora"), "lora_bias": cfg.get("lora_bias"),
                   "modules_to_save": cfg.get("modules_to_save"), "bias": cfg.get("bias") not in (None, "none")}
    bad = sorted(k for k, v in unsupported.items() if v)
    if cfg.get("peft_type", "LORA") != "LORA" or bad:
        raise ExportError(f"{src / ADAPTER_CONFIG}: a merge of {cfg.get('peft_type')} with {bad} is not supported; "
                          "export it with --adapter")
    return cfg


def scaling(cfg: dict[str, Any]) -> float:
    """PEFT's scaling of B @ A: alpha / r (alpha / sqrt(r) with rsLoRA)."""
    r, alpha = int(cfg["r"]), float(cfg["lora_alpha"])
    return alpha / r ** 0.5 if cfg.get("use_rslora") else alpha / r


def read_adapter(src: Path) -> dict[str, Any]:
    """The adapter's tensors by the base model's module paths (`<module>.lora_A.weight`)."""
    from safetensors.torch import load_file

    tensors = {k.removeprefix(PEFT_PREFIX): v for k, v in load_file(str(src / ADAPTER_FILE)).items()}
    try:
        pairs(tensors)
    except AdapterError as exc:
        raise ExportError(f"{src / ADAPTER_FILE}: {exc}") from exc
    return tensors


class LoraSource:
    """The merged model, tensor by tensor: a base reader (export_sources) with the adapter applied on read."""

    kind = "lora"

    def __init__(self, base: Any, src: Path):
        self.base = base
        self.adapter = read_adapter(src)
        self.scaling = scaling(adapter_config(src))
        try:  # every module a linear of this base, ranks and shapes consistent: before anything is written
            self.modules = check_adapter(self.adapter, {n: base.meta(n)[0] for n in base.names()})
        except AdapterError as exc:
            raise ExportError(f"LoRA checkpoint {src} does not fit its base: {exc}") from exc

    def names(self) -> list[str]:
        return self.base.names()

    def meta(self, name: str) -> tuple[tuple[int, ...], Any]:
        return self.base.meta(name)

    def read(self, name: str) -> Any:
        """The base tensor, or W + scaling * B @ A in fp32 for an adapted module (cast once by the writer)."""
        import torch

        value = self.base.read(name)
        module = name.removesuffix(".weight")
        if name.endswith(".weight") and module in self.modules:
            a, b = self.modules[module]
            halves = {f"{module}.lora_A.weight": a, f"{module}.lora_B.weight": b}
            value = merge({name: value.to(torch.float32)}, halves, self.scaling)[name]
        return value

    def __enter__(self) -> "LoraSource":
        self.base.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.base.__exit__(*exc)
