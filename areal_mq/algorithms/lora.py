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
import re
from typing import TYPE_CHECKING, Any, Iterator, Literal, Mapping

from pydantic import BaseModel, ConfigDict, Field, field_validator

from areal_mq.weights.adapter import MAX_RANK, AdapterError, check_adapter, merge, pairs  # noqa: F401

if TYPE_CHECKING:
    import torch

PEFT_PREFIX = "base_model.model."  # what PEFT puts before the base model's own module paths
_MODULE_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")


class LoraConfig(BaseModel):
    """trainer.lora: train a low-rank adapter on a frozen base instead of every weight."""
    model_config = ConfigDict(extra="forbid")

    rank: int = Field(16, ge=1, le=MAX_RANK, description="the adapter's rank r (A is r x in, B is out x r)")
    alpha: float = Field(32.0, gt=0, description="the update is scaled by alpha / rank (PEFT's lora_alpha)")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="dropout on the adapter's input while training")
    target_modules: list[str] | Literal["all-linear"] = Field(
        "all-linear", description="linear modules that get an adapter: 'all-linear' (every linear of the decoder "
        "layers, not the output head) or names such as [q_proj, k_proj, v_proj, o_proj]")

    @field_validator("target_modules")
    @classmethod
    def _names(cls, v: Any) -> Any:
        if isinstance(v, list):
            if not v or len(v) > 32:
                raise ValueError("target_modules: give 1 to 32 module names, or 'all-linear'")
            bad = [n for n in v if not _MODULE_NAME.match(n)]
            if bad:
                raise ValueError(f"target_modules: {bad} are not module names (letters, digits, _)")
        return v

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank

    def meta(self) -> dict[str, Any]:
        """What a publication of this adapter announces beside its tensors (WeightsReady.adapter)."""
        targets = self.target_modules if isinstance(self.target_modules, str) else list(self.target_modules)
        return {"rank": self.rank, "alpha": self.alpha, "scaling": self.scaling, "target_modules": targets}


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
    missing = [k for k in getattr(result, "unexpected_keys", []) if "lora_" in k]
    if missing:
        raise AdapterError(f"adapter tensors the model has no place for: {missing[:4]}")
