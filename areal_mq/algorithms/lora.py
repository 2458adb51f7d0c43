"""LoRA policies (trainer.lora): the base frozen in the engine's dtype, a PEFT adapter trained in fp32.

What:
- `LoraConfig`: rank, alpha, dropout and the target modules ("all-linear", or module names such as q_proj).
- `attach(model, cfg, base_dtype)`: freezes the model in `base_dtype` (no fp32 master copy of frozen weights: they
  never change) and wraps it with PEFT; only the adapter's A and B matrices train, in fp32, so AdamW holds 2 x 4
  bytes of state per adapter parameter and nothing for the base.
- `reference(model)`: the reference policy is the base with the adapter switched off (a context manager): no second
  model in memory, and exactly the weights the run started from.
- `adapter_tensors(model)`: what a trainer publishes and checkpoints, named by the base model's module paths
  (`model.layers.0.self_attn.q_proj.lora_A.weight`, `...lora_B.weight`), so an engine maps them to its own weights
  by name without knowing PEFT.
- `merge` and `check_adapter` (areal_mq/weights/adapter.py, re-exported): the adapter form every receiver checks
  and merges (W + scaling * B @ A from the kept base, rounded once).

Why PEFT: the field's library for it (TRL, verl and AReaL use it): target-module matching, dropout and
`disable_adapter` are its, tested by many; this module only pins the dtypes and names the public forms.

How to run: tests/unit/algorithms/test_lora.py (tiny random Llama and Qwen2: reference == base, merge == PEFT's
merge_and_unload, hostile adapters refused).
"""
from __future__ import annotations

import contextlib
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Mapping

from areal_mq.algorithms.config import LoraConfig  # noqa: F401  (trainer.lora)
from areal_mq.weights.adapter import MAX_RANK, AdapterError, check_adapter, merge, pairs  # noqa: F401

if TYPE_CHECKING:
    import torch

PEFT_PREFIX = "base_model.model."  # what PEFT puts before the base model's own module paths


def attach(model: Any, cfg: LoraConfig, base_dtype: "torch.dtype") -> Any:
    """`model` frozen in `base_dtype` with a fresh PEFT adapter (B = 0: the policy starts as the base) in fp32."""
    import torch
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    model.to(base_dtype)
    model.requires_grad_(False)
    peft_cfg = PeftLoraConfig(r=cfg.rank, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout, bias="none",
                              target_modules=cfg.target_modules, task_type="CAUSAL_LM")
    wrapped = get_peft_model(model, peft_cfg)
    for p in wrapped.parameters():
        if p.requires_grad:
            p.data = p.data.to(torch.float32)
    return wrapped


def trainable(model: Any) -> list[Any]:
    return [p for p in model.parameters() if p.requires_grad]


@contextlib.contextmanager
def reference(model: Any) -> Iterator[None]:
    """The base policy for the duration: the adapter switched off (the KL reference, for free)."""
    with model.disable_adapter():
        yield


def adapter_tensors(model: Any) -> dict[str, "torch.Tensor"]:
    """The adapter's tensors by the base model's module paths (detached, on their device, fp32)."""
    from peft import get_peft_model_state_dict

    return {k.removeprefix(PEFT_PREFIX): v.detach() for k, v in get_peft_model_state_dict(model).items()}


def load_adapter(model: Any, tensors: Mapping[str, "torch.Tensor"]) -> None:
    """Copy published/checkpointed adapter tensors (adapter_tensors' names) into a PEFT model's adapter."""
    from peft import set_peft_model_state_dict

    result = set_peft_model_state_dict(model, {PEFT_PREFIX + k: v for k, v in tensors.items()})
    unplaced = [k for k in getattr(result, "unexpected_keys", []) if "lora_" in k]
    if unplaced:
        raise AdapterError(f"adapter tensors the model has no place for: {unplaced[:4]}")


def base_dtype(precision: str) -> "torch.dtype":
    """The frozen base's dtype: what the training precision computes in (fp32, bf16, fp16); no fp32 master copy of
    weights that never change."""
    import torch

    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]


def snapshot(model: Any, dtype: str | None) -> dict[str, "torch.Tensor"]:
    """The adapter as published: host copies in `dtype` (a sharded adapter's whole tensors: under FSDP2 a collective
    every rank joins)."""
    import torch

    out = {}
    for name, t in adapter_tensors(model).items():
        full = t.full_tensor() if hasattr(t, "full_tensor") else t
        out[name] = full.detach().to(device="cpu", dtype=getattr(torch, dtype) if dtype else full.dtype, copy=True)
    return out


ADAPTER_FILE = "adapter_model.safetensors"  # PEFT's own file name: a checkpoint's adapter loads with PeftModel too
BASE_FILE = "base_model.json"


def base_identity(model_path: str | Path) -> dict[str, str]:
    """The base an adapter belongs to: its path and a sha256 over its weight files (name, size and bytes), read
    once per trainer start (seconds for a 7B model) and written into every checkpoint."""
    import hashlib

    root = Path(model_path)
    digest = hashlib.sha256()
    for f in sorted(root.glob("*.safetensors")):
        digest.update(f.name.encode() + b"\0" + str(f.stat().st_size).encode() + b"\0")
        with open(f, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 24), b""):
                digest.update(block)
    return {"path": str(root.resolve()), "sha256": digest.hexdigest()}


def save(model: Any, directory: Path, identity: Mapping[str, str]) -> None:
    """A checkpoint's model part under LoRA: the adapter (PEFT's adapter_model.safetensors and adapter_config.json,
    so `PeftModel.from_pretrained(base, dir)` loads it) and the base's identity; never the frozen base."""
    import json

    model.save_pretrained(str(directory), safe_serialization=True)
    (Path(directory) / BASE_FILE).write_text(json.dumps(dict(identity), indent=1))


def load(model: Any, directory: Path, identity: Mapping[str, str]) -> None:
    """The adapter of a LoRA checkpoint into `model`, refusing one trained on another base."""
    import json

    from safetensors.torch import load_file

    from areal_mq.errors import ConfigError

    directory = Path(directory)
    if not (directory / ADAPTER_FILE).is_file():
        raise ConfigError(f"checkpoint {directory} holds no LoRA adapter ({ADAPTER_FILE}): it was saved by a full "
                          "fine-tuning run; resume it without trainer.lora")
    saved = json.loads((directory / BASE_FILE).read_text()) if (directory / BASE_FILE).is_file() else {}
    if saved.get("sha256") and saved["sha256"] != identity.get("sha256"):
        raise ConfigError(f"checkpoint {directory}'s adapter was trained on the base at {saved.get('path')} "
                          f"(sha256 {saved['sha256'][:12]}...), not on {identity.get('path')} "
                          f"(sha256 {identity.get('sha256', '')[:12]}...): resume with the same model.name")
    load_adapter(model, {k.removeprefix(PEFT_PREFIX): v for k, v in load_file(str(directory / ADAPTER_FILE)).items()})
