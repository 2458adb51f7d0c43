"""The adapter form of a weight version (trainer.lora; WeightsReady.adapter in docs/protocol.md): names, checks, merge.

What: a LoRA publication's tensors are `<module>.lora_A.weight` [rank, in] and `<module>.lora_B.weight` [out, rank],
named by the base model's module paths.
- `pairs(adapter)`: {module: (A, B)}, refusing any other name (a name is never a path, code or anything but a dotted
  module path of bounded length) and a module without both halves;
- `check_adapter(adapter, base_shapes, max_rank)`: every module is a linear of this base, the ranks agree and are
  bounded, B @ A has the weight's shape; a receiver calls it before merging anything it was sent;
- `merge(base, adapter, scaling)`: W + scaling * B @ A per module in fp32, rounded once to W's dtype: what an engine
  holding full weights loads and what a merged export writes. Always from the base (never from the previous merge),
  so rounding does not accumulate over versions.

Used by the trainer's LoRA (areal_mq/algorithms/lora.py), the torch engine (areal_mq/engines/torch/adapter.py) and
the export. Tests: tests/unit/algorithms/test_lora.py.
"""
from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any, Mapping

from areal_mq.errors import WeightsBaseMismatch, WeightsLoadError

if TYPE_CHECKING:
    import torch

HALVES = ("lora_A", "lora_B")
MAX_RANK = 1024
_ADAPTER_KEY = re.compile(r"^((?:[A-Za-z_][A-Za-z0-9_]{0,63}\.|[0-9]{1,6}\.){1,16})(lora_A|lora_B)\.weight$")


class AdapterError(WeightsLoadError):
    """An adapter that cannot be applied to this base (names, halves, shapes, rank)."""


def pairs(adapter: Mapping[str, Any]) -> dict[str, tuple[Any, Any]]:
    """{module path: (A, B)} from adapter tensors named `<module>.lora_A.weight` / `<module>.lora_B.weight`."""
    halves: dict[str, dict[str, Any]] = {}
    for key, t in adapter.items():
        m = _ADAPTER_KEY.match(key) if isinstance(key, str) else None
        if m is None:
            raise AdapterError(f"adapter tensor {str(key)[:120]!r} is not named <module>.lora_A.weight or "
                               "<module>.lora_B.weight")
        halves.setdefault(m.group(1)[:-1], {})[m.group(2)] = t
    out = {}
    for module, h in halves.items():
        if set(h) != set(HALVES):
            raise AdapterError(f"adapter module {module!r} has {sorted(h)}, needs both lora_A and lora_B")
        out[module] = (h["lora_A"], h["lora_B"])
    return out


def check_adapter(adapter: Mapping[str, Any], base_shapes: Mapping[str, tuple[int, ...]],
                  max_rank: int = MAX_RANK) -> dict[str, tuple[Any, Any]]:
    """The adapter's (A, B) per module after checking it against the base's weight shapes ({name: shape}).
    Raises AdapterError naming the first problem; a receiver calls this before merging anything it was sent."""
    out = pairs(adapter)
    for module, (a, b) in out.items():
        shape = base_shapes.get(module + ".weight")
        if shape is None or len(shape) != 2:
            raise AdapterError(f"adapter module {module!r} is not a linear of this model")
        if a.dim() != 2 or b.dim() != 2:
            raise AdapterError(f"adapter module {module!r}: A and B must be matrices")
        rank = a.shape[0]
        if not 1 <= rank <= max_rank or b.shape[1] != rank:
            raise AdapterError(f"adapter module {module!r}: rank {rank} (A {list(a.shape)}, B {list(b.shape)}) "
                               f"is not consistent or exceeds {max_rank}")
        if (b.shape[0], a.shape[1]) != tuple(shape):
            raise AdapterError(f"adapter module {module!r}: B @ A is {[b.shape[0], a.shape[1]]}, the weight is "
                               f"{list(shape)}")
    return out


def merge(base: Mapping[str, "torch.Tensor"], adapter: Mapping[str, "torch.Tensor"],
          scaling: float) -> dict[str, "torch.Tensor"]:
    """{"<module>.weight": W + scaling * B @ A} for every adapted module, in fp32 on W's device, rounded once to
    W's dtype. `base` holds the base weights by name (the kept, never-merged copy)."""
    pairs_ = check_adapter(adapter, {k: tuple(v.shape) for k, v in base.items()})
    return {module + ".weight": merged(base[module + ".weight"], a, b, scaling) for module, (a, b) in pairs_.items()}


def merged(w: "torch.Tensor", a: "torch.Tensor", b: "torch.Tensor", scaling: float) -> "torch.Tensor":
    """W + scaling * B @ A on W's device, in fp32, rounded once to W's dtype (the one merge every user calls)."""
    import torch

    delta = b.to(w.device, torch.float32) @ a.to(w.device, torch.float32)
    return (w.to(torch.float32) + scaling * delta).to(w.dtype)


def refuse_other_base(what: str, want: str, ours: str) -> None:
    """WeightsBaseMismatch where an adapter (`what`) trained on the base `want` meets an engine whose base is `ours`
    (the rollout worker's catch-up and the evaluations' load_version_dir: one check, one message)."""
    if ours != want:
        raise WeightsBaseMismatch(
            f"{what} is a LoRA adapter trained on the base with sha256 {want[:16]}..., and this engine's base is "
            f"{ours[:16]}...: it is refused (the engine keeps the weights it has). Start the rollout workers and "
            "evaluations on the trainer's base model (model.name, model.cache_dir)")
