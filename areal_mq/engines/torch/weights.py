"""In-place weight loading for the torch engine: validate everything first, then copy.

What: `load_weights_in_place(model, tensors=... | path=...)` copies new values into the model's
existing parameter tensors (no module re-construction, so the engine's fused views and KV cache stay
valid). Sources: a mapping name -> torch.Tensor / numpy array, or a safetensors file or a directory
of *.safetensors files (read tensor by tensor, so peak memory stays about one tensor).
Each copy lands on the parameter's own device (CPU sources are copied onto a CUDA engine) and into the
same storage, so the fused views and a captured CUDA graph (graphs.py) see the new values.

Why validate first: a bad update (unknown name, wrong shape, missing parameter) must leave the
engine serving the old weights intact, with an error that names the offending tensors.
Tied parameters (lm_head.weight == embed_tokens.weight) count as present under either name.

`patch_weights_in_place(model, patches)` writes only changed elements: name -> (flat positions, new values), what
a verified weight delta changed (areal_mq/weights/delta.py `changed_elements`, computed off the decode loop). The
engine pauses for a scatter of ~1 % of the elements instead of a copy of all of them; the result is the same
parameters, element for element, as a full load of the new version (values are cast to the parameter's dtype
exactly as `copy_` casts them). `stage_patches(model, patches)` does every check and conversion beforehand (on the
weight fetch thread), so the pause itself is only the scatter.
"""
from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Callable, Mapping

import torch

from areal_mq.errors import WeightsLoadError


def _alias_groups(model: torch.nn.Module) -> tuple[dict[str, torch.Tensor], list[list[str]]]:
    """name -> parameter for every name (tied ones too), and the names grouped by tensor."""
    by_name: dict[str, torch.Tensor] = {}
    groups: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        by_name[name] = param
        groups.setdefault(id(param), []).append(name)
    return by_name, list(groups.values())


def _source(tensors: Mapping[str, Any] | None, path: str | None,
            stack: contextlib.ExitStack) -> tuple[dict[str, tuple], Callable[[str], Any]]:
    """(name -> shape, getter) for a tensor mapping or a safetensors file/dir (handles kept in stack)."""
    if (tensors is None) == (path is None):
        raise WeightsLoadError("update_weights needs exactly one of tensors= or path=")
    if tensors is not None:
        shapes = {k: tuple(getattr(v, "shape", ())) for k, v in tensors.items()}
        return shapes, lambda k: tensors[k]
    from safetensors import safe_open

    root = Path(path)
    files = sorted(root.glob("*.safetensors")) if root.is_dir() else [root]
    if not files or not all(f.is_file() for f in files):
        raise WeightsLoadError(f"no safetensors weights at {root} (expected a .safetensors file or a "
                                 f"directory holding *.safetensors)")
    where: dict[str, Any] = {}
    shapes = {}
    for f in files:
        try:
            fh = stack.enter_context(safe_open(str(f), framework="pt"))
            for k in fh.keys():
                shapes[k] = tuple(fh.get_slice(k).get_shape())
                where[k] = fh
        except Exception as exc:  # safetensors raises its own error types for corrupt headers
            raise WeightsLoadError(f"cannot read weights file {f}: {exc}") from exc
    return shapes, lambda name: where[name].get_tensor(name)


def _check(by_name: dict[str, torch.Tensor], groups: list[list[str]], shapes: dict[str, tuple]) -> None:
    unknown = sorted(k for k in shapes if k not in by_name)
    if unknown:
        raise WeightsLoadError(f"weight update has {len(unknown)} tensors the model does not have, e.g. "
                                 f"{unknown[:5]}; was it saved from a different model?")
    missing = [g[0] for g in groups if not any(n in shapes for n in g)]
    if missing:
        raise WeightsLoadError(f"weight update misses {len(missing)} parameters, e.g. {missing[:5]}; "
                                 f"publish the full state dict.")
    wrong = [f"{k}: got {list(s)}, model has {list(by_name[k].shape)}"
             for k, s in shapes.items() if tuple(by_name[k].shape) != s]
    if wrong:
        raise WeightsLoadError(f"weight update has wrong shapes: {'; '.join(wrong[:5])}")


def load_weights_in_place(model: torch.nn.Module, tensors: Mapping[str, Any] | None = None,
                          path: str | None = None) -> int:
    """Copy a full state dict into `model`'s parameters; returns the number of tensors copied.

    Raises WeightsLoadError (and changes nothing) for unknown names, wrong shapes or missing
    parameters.
    """
    by_name, groups = _alias_groups(model)
    copied = 0
    with contextlib.ExitStack() as stack, torch.no_grad():
        shapes, get = _source(tensors, None if path is None else str(path), stack)
        _check(by_name, groups, shapes)
        for group in groups:
            name = next(n for n in group if n in shapes)  # one copy per tied tensor
            value = get(name)
            if not isinstance(value, torch.Tensor):
                value = torch.as_tensor(value)
            by_name[name].copy_(value)
            copied += 1
    return copied


class StagedPatches:
    """Weight patches already checked against a model and converted for it (positions as int64 and values in the
    parameter's dtype, both on its device): what `stage_patches` returns and `patch_weights_in_place` applies with
    nothing left to do but the scatter. Built on the weight fetch thread, so the engine's pause is only the write."""

    def __init__(self, model: torch.nn.Module, writes: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]):
        self.model_id = id(model)
        self.writes = writes

    def __len__(self) -> int:
        return len(self.writes)


def stage_patches(model: torch.nn.Module, patches: Mapping[str, tuple[Any, Any]]) -> StagedPatches:
    """Check `patches` (name -> (flat positions, values)) against `model` and convert them for it; changes nothing.

    Raises WeightsLoadError for an unknown name, a tied tensor patched under two names, positions and values of
    different lengths, or a position outside the parameter.
    """
    by_name, groups = _alias_groups(model)
    group_of = {n: i for i, g in enumerate(groups) for n in g}
    seen: dict[int, str] = {}
    writes = []
    for name, (positions, values) in patches.items():
        param = by_name.get(name)
        if param is None:
            raise WeightsLoadError(f"weight patch names {name!r}, which the model does not have")
        if group_of[name] in seen:
            raise WeightsLoadError(f"weight patch writes one tied tensor twice ({seen[group_of[name]]!r}, {name!r})")
        seen[group_of[name]] = name
        positions = torch.as_tensor(positions, dtype=torch.int64)
        values = torch.as_tensor(values)
        if positions.dim() != 1 or positions.shape != values.reshape(-1).shape:
            raise WeightsLoadError(f"weight patch of {name!r}: {positions.numel()} positions for "
                                   f"{values.numel()} values (one value per position)")
        if positions.numel() and (int(positions.min()) < 0 or int(positions.max()) >= param.numel()):
            raise WeightsLoadError(f"weight patch of {name!r} writes outside its {param.numel()} elements")
        if positions.numel():
            writes.append((param, positions.to(param.device),
                           values.reshape(-1).to(device=param.device, dtype=param.dtype)))
    return StagedPatches(model, writes)


def patch_weights_in_place(model: torch.nn.Module, patches: "Mapping[str, tuple[Any, Any]] | StagedPatches") -> int:
    """Write `values` at the flat `positions` of each named parameter, in place; returns the elements written.
    `patches` may be staged already (`stage_patches`, off the pause): then only the scatter runs here.

    Raises WeightsLoadError (and changes nothing) for an unknown name, a tied tensor patched under two names,
    positions and values of different lengths, a position outside the parameter, or patches staged for another
    model.
    """
    staged = patches if isinstance(patches, StagedPatches) else stage_patches(model, patches)
    if staged.model_id != id(model):
        raise WeightsLoadError("weight patches were staged for another model")
    written = 0
    with torch.no_grad():
        for param, positions, values in staged.writes:
            if param.is_contiguous():  # a flat scatter: ~4x faster than an n-d index_put of the same elements
                param.view(-1).index_copy_(0, positions, values)
            else:  # a view into a fused tensor: write through its strides
                param.index_put_(torch.unravel_index(positions, param.shape), values)
            written += positions.numel()
    return written
