"""LoRA policies (trainer.lora): the base frozen in the engine's dtype, a PEFT adapter trained in fp32.

What:
- `LoraConfig`: rank, alpha, dropout and the target modules ("all-linear", or module names such as q_proj).
- `attach(model, cfg, base_dtype, seed)`: freezes the model in `base_dtype` (no fp32 master copy of frozen weights:
  they never change) and wraps it with PEFT; only the adapter's A and B matrices train, in fp32, so AdamW holds
  2 x 4 bytes of state per adapter parameter and nothing for the base. The start adapter is `initial_adapter`
  (seeded, whatever the device), so a model built on the meta device and sharded (fsdp: algorithms/fsdp.py, the
  base's shards read under `base_name`) starts where a whole one (ddp) does.
- `reference(model)`: the reference policy is the base with the adapter switched off (a context manager): no second
  model in memory, and exactly the weights the run started from.
- `adapter_tensors(model)`: what a trainer publishes and checkpoints, named by the base model's module paths
  (`model.layers.0.self_attn.q_proj.lora_A.weight`, `...lora_B.weight`), so an engine maps them to its own weights
  by name without knowing PEFT.
- `merge` and `check_adapter` (areal_mq/weights/adapter.py, re-exported): the adapter form every receiver checks
  and merges (W + scaling * B @ A from the kept base, rounded once).

Why PEFT: the field's library for it (TRL, verl and AReaL use it): target-module matching, dropout and
`disable_adapter` are its, tested by many; this module only pins the dtypes and names the public forms.

Under FSDP2 `snapshot` and `save` gather the sharded adapter (collectives every rank joins; rank 0 keeps it).

How to run: tests/unit/algorithms/test_lora.py (tiny random Llama and Qwen2: reference == base, merge == PEFT's
merge_and_unload, hostile adapters refused); 2 fsdp ranks against ddp: tests/integration/test_trainer_fsdp_lora.py.
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


def attach(model: Any, cfg: LoraConfig, base_dtype: "torch.dtype", seed: int | None = None) -> Any:
    """`model` frozen in `base_dtype` with a fresh PEFT adapter (B = 0: the policy starts as the base) in fp32.
    Parameters only are cast: buffers (the rotary frequencies) stay as built, in fp32 as the engines keep them.
    `seed`: the adapter starts from `initial_adapter(wrapped, seed)` (a model on the meta device is filled later
    by its strategy); None keeps PEFT's draw from the global RNG."""
    import torch

    from areal_mq.errors import require_extra

    require_extra("peft", "lora", "trainer.lora")  # a clear ConfigError (what to install) where PEFT is missing
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    model.requires_grad_(False)
    for p in model.parameters():
        p.data = p.data.to(base_dtype)
    peft_cfg = PeftLoraConfig(r=cfg.rank, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout, bias="none",
                              target_modules=cfg.target_modules, task_type="CAUSAL_LM")
    wrapped = get_peft_model(model, peft_cfg)
    for p in wrapped.parameters():
        if p.requires_grad:
            p.data = p.data.to(torch.float32)
    if seed is not None and not any(p.is_meta for p in wrapped.parameters()):
        start = initial_adapter(wrapped, seed)
        with torch.no_grad():
            for name, p in wrapped.get_base_model().named_parameters():
                if name in start:
                    p.copy_(start[name])
    return wrapped


def initial_adapter(model: Any, seed: int) -> dict[str, "torch.Tensor"]:
    """The adapter a run starts from, whole, fp32 on the CPU, by the base model's parameter names
    (`model.layers.0.self_attn.q_proj.lora_A.default.weight`): each A drawn as PEFT draws it (kaiming_uniform,
    a = sqrt(5): uniform in +-1 / sqrt(in)) but from a generator seeded with `seed`, B = 0. A function of the
    names, shapes and seed only, so a model built whole (ddp) and one built on the meta device and sharded (fsdp,
    each rank copying its rows) start from the same adapter."""
    import math

    import torch

    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, p in model.get_base_model().named_parameters():
        if p.requires_grad:
            t = torch.zeros(tuple(p.shape), dtype=torch.float32)
            if ".lora_A." in name:
                torch.nn.init.kaiming_uniform_(t, a=math.sqrt(5), generator=gen)
            out[name] = t
    return out


def base_name(name: str) -> str:
    """The checkpoint name of a wrapped base parameter: PEFT moves an adapted linear's weight to
    `<module>.base_layer.weight`; the base model's files call it `<module>.weight`."""
    return name.replace(".base_layer.", ".")


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


def snapshot(model: Any, dtype: str | None, keep: bool = True) -> dict[str, "torch.Tensor"]:
    """The adapter as published: host copies in `dtype`, adapter_tensors' names. A sharded adapter (FSDP2) is
    gathered whole one tensor at a time, a collective every rank joins in the same order; only a rank with `keep`
    stores the tensors (the others return {})."""
    import torch

    out = {}
    for name, t in adapter_tensors(model).items():
        full = t.full_tensor() if hasattr(t, "full_tensor") else t
        if keep:
            want = getattr(torch, dtype) if dtype else full.dtype
            out[name] = full.detach().to(device="cpu", dtype=want, copy=True)
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


def save(model: Any, directory: Path, identity: Mapping[str, str], keep: bool = True) -> None:
    """A checkpoint's model part under LoRA: the adapter (PEFT's adapter_model.safetensors and adapter_config.json,
    so `PeftModel.from_pretrained(base, dir)` loads it) and the base's identity; never the frozen base. A sharded
    adapter is gathered first (a collective every rank joins); only a rank with `keep` writes."""
    import json

    state = {}
    for name, t in model.state_dict().items():  # PEFT's names; the base's entries are not touched (no gather)
        if "lora_" in name:
            state[name] = (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().cpu()
    if keep:
        model.save_pretrained(str(directory), safe_serialization=True, state_dict=state)
        (Path(directory) / BASE_FILE).write_text(json.dumps(dict(identity), indent=1))


def check(directory: Path, identity: Mapping[str, str]) -> None:
    """Refuse checkpoint `directory` unless it holds a LoRA adapter trained on the base `identity` names."""
    import json

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


def load(model: Any, directory: Path, identity: Mapping[str, str]) -> None:
    """The adapter of a LoRA checkpoint into `model` (whole, not sharded), refusing one trained on another base."""
    from safetensors.torch import load_file

    check(directory, identity)
    tensors = load_file(str(Path(directory) / ADAPTER_FILE))
    load_adapter(model, {k.removeprefix(PEFT_PREFIX): v for k, v in tensors.items()})
