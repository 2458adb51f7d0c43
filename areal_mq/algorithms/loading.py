"""Building the policy without the whole model on every rank: meta-device construction and sharded loading.

What: `meta_causal_lm(dir)` builds a Hugging Face causal LM from its config with every parameter on the meta device
(no memory; buffers such as rotary frequencies are real, they are computed from the config, not read);
`checkpoint_files(dir)` maps each tensor name to the safetensors file that holds it (one `model.safetensors`, or the
`model-0000x-of-0000y.safetensors` shards listed by `model.safetensors.index.json`); once the strategy has sharded
the meta model (fsdp.py), `materialise(policy, lm, dir, device, how)` allocates each rank's shards only and fills
them from the checkpoint:

    how = slices     every rank opens the files memory-mapped and reads just the rows it owns (safetensors
                     get_slice): no collective, each rank's host touches its shard's bytes only
    how = broadcast  rank 0 reads each tensor whole and broadcasts it; every rank keeps its slice (the other way
                     the field does it: one reader, for file systems where every rank reading is slow)

Why slices is the default (trainer.fsdp.load), measured by `python benchmarks/speed/trainer.py --load` (2 gloo ranks,
bf16 sharded checkpoints, benchmarks/speed/RESULTS.md): the host peak per rank is the lowest (Qwen2.5-0.5B: slices
1.39 / 1.39 GiB, broadcast 1.48 / 1.32 with rank 0 carrying each whole tensor, full 3.14 / 3.14), and loading is as
fast or faster (1.5B: loaded 18.1 s after the launch with slices, 24.3 s with broadcast, which sends every byte of
the model through rank 0 and the process group); the time to the first step's end is the same within the shared
machine's noise at 0.5B (slices 62.7 s, broadcast 57.5 s, full 60.1 s: the step dominates). Broadcast stays for a
file system where every rank reading is slow; `full` is the old path (every rank loads the whole model in fp32,
then shards), kept for the benchmark and the parity tests.
Cost per rank: its fp32 shard (4 bytes x parameters / shard degree) plus, while loading, one slice in the file's
dtype; nothing of the whole model (areal_mq/launch/plan.py counts it).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Mapping

import torch
from torch import nn

from areal_mq.errors import ConfigError

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
LOADS = ("slices", "broadcast", "full")  # trainer.fsdp.load


def checkpoint_files(model_dir: str | Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it: the index of a sharded checkpoint, else every *.safetensors."""
    from safetensors import safe_open

    model_dir = Path(model_dir)
    index = model_dir / INDEX
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: model_dir / fname for name, fname in weight_map.items()}
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"{model_dir} has no {SINGLE} and no {INDEX}: the sharded loader reads safetensors only "
                          "(convert the checkpoint, or set trainer.fsdp.load: full)")
    out: dict[str, Path] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as handle:
            out.update({name: f for name in handle.keys()})
    return out


def meta_causal_lm(model_dir: str | Path) -> nn.Module:
    """The model of `model_dir`'s config in fp32, parameters on the meta device, buffers real (on the CPU)."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(model_dir), local_files_only=True)
    with init_empty_weights(include_buffers=False):
        lm = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    lm.tie_weights()  # from_pretrained ties the head to the embeddings; from_config on meta does not
    return lm.eval()


class _Files:
    """The safetensors file a tensor is in, memory-mapped, one open at a time: the pages a rank touched are
    resident (and counted in its RSS) while its file is mapped, so moving to the next file unmaps the previous
    one (a checkpoint's shard files follow the state dict's order, so each opens once)."""

    def __init__(self, where: dict[str, Path]):
        self.where, self._path, self._handle = where, None, None

    def slice(self, name: str) -> Any:
        from safetensors import safe_open

        path = self.where[name]
        if path != self._path:
            self.close()
            self._path, self._handle = path, safe_open(str(path), framework="pt")
        return self._handle.get_slice(name)

    def close(self) -> None:
        self._path = self._handle = None


def local_box(param: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(shape, global offset) of this rank's part of `param` (a DTensor; a plain tensor is wholly local)."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if not isinstance(param, DTensor):
        return tuple(param.shape), (0,) * param.dim()
    shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    return tuple(shape), tuple(offset)


def _restore_buffers(lm: nn.Module, buffers: dict[str, torch.Tensor], device: torch.device) -> None:
    """Put back the real buffers `to_empty` replaced with uninitialised memory (rotary frequencies and the like)."""
    for name, buf in buffers.items():
        owner, _, leaf = name.rpartition(".")
        mod = lm.get_submodule(owner) if owner else lm
        mod._buffers[leaf] = buf.to(device)


def materialise(policy: nn.Module, lm: nn.Module, model_dir: str | Path, device: torch.device,
                how: str = "slices", rename: Callable[[str], str] | None = None,
                given: Mapping[str, torch.Tensor] | None = None) -> None:
    """Allocate the shards of a sharded meta `policy` (whose Hugging Face model is `lm`) on `device` and fill them
    from `model_dir`'s safetensors, `how` slices or broadcast (module docstring). Collective under broadcast.
    A wrapped model (a LoRA policy, algorithms/lora.py) names its parameters otherwise: `rename` maps a parameter
    name to the checkpoint's, and a parameter in `given` (whole tensors, the same on every rank: a fresh adapter)
    is filled from there, each rank copying its own box, instead of from the checkpoint."""
    if how not in ("slices", "broadcast"):
        raise ConfigError(f"trainer.fsdp.load must be one of {LOADS}, got {how!r}")
    buffers = {name: b for name, b in lm.named_buffers()}
    policy.to_empty(device=device)
    _restore_buffers(lm, buffers, device)
    files = _Files(checkpoint_files(model_dir))
    given = given or {}
    try:
        with torch.no_grad():
            for name, param in lm.named_parameters():  # once each: a tied head comes under its first name
                local = param.to_local() if hasattr(param, "to_local") else param
                shape, offset = local_box(param)
                if name in given:
                    part = given[name][tuple(slice(o, o + n) for o, n in zip(offset, shape))] if all(shape) else None
                else:
                    source = rename(name) if rename is not None else name
                    if source not in files.where:
                        raise ConfigError(f"{model_dir}: the checkpoint has no tensor {source!r}; was it saved from "
                                          "another model?")
                    part = (_read_slice(files, source, shape, offset) if how == "slices"
                            else _broadcast_slice(files, source, param, shape, offset, device))
                if part is not None:
                    local.copy_(part)
    finally:
        files.close()


def _read_slice(files: _Files, name: str, shape: tuple[int, ...], offset: tuple[int, ...]) -> torch.Tensor | None:
    """Rows `offset .. offset + shape` of tensor `name`, read from the memory-mapped file (only those bytes)."""
    if not all(shape):
        return None  # more ranks than rows: this rank holds none of it
    box = tuple(slice(o, o + n) for o, n in zip(offset, shape))
    return files.slice(name)[box] if box else files.slice(name)[:]


def _broadcast_slice(files: _Files, name: str, param: Any, shape: tuple[int, ...], offset: tuple[int, ...],
                     device: torch.device) -> torch.Tensor | None:
    """Rank 0 reads tensor `name` whole and broadcasts it (in the file's dtype); every rank returns its box."""
    import torch.distributed as dist

    if dist.get_rank() == 0:
        full = files.slice(name)[:]
    else:
        whole = files.slice(name)
        full = torch.empty(whole.get_shape(), dtype=_DTYPES[whole.get_dtype()])
    comm = full.to(device) if device.type != "cpu" else full  # nccl broadcasts device tensors
    dist.broadcast(comm, src=0)
    if not all(shape):
        return None
    return comm[tuple(slice(o, o + n) for o, n in zip(offset, shape))]


_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F64": torch.float64,
           "I64": torch.int64, "I32": torch.int32, "U8": torch.uint8, "BOOL": torch.bool}


def load_whole(model_dir: str | Path, device: torch.device, dtype: torch.dtype = torch.float32) -> nn.Module:
    """The whole model in `dtype` (fp32: full fine-tuning's master weights; trainer.lora: the frozen base's dtype, so
    no fp32 copy of a frozen weight is ever made, not even while loading) with its weights on `device`, read straight
    there (one full copy: on a GPU no copy of the model is made on the host first; the data-parallel path and
    trainer.fsdp.load full). Buffers computed at build (the rotary frequencies) stay fp32 whatever `dtype` is."""
    from areal_mq.engines.models import load_causal_lm

    if device.type in ("cpu", "meta"):
        return load_causal_lm(model_dir, str(dtype).removeprefix("torch."), device)
    from transformers import AutoModelForCausalLM

    from areal_mq.engines.models import check_model_dir, no_hub_kernels

    check_model_dir(Path(model_dir))
    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype, local_files_only=True,
                                                device_map=str(device), **no_hub_kernels()).eval()
