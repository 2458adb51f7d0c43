"""Export a trainer checkpoint as the model directory users deploy (`areal-mq checkpoint export`).

What: `export_model(src, out, dtype="bfloat16", max_shard_size="5GB")` writes into `out`
- model-0000i-of-0000n.safetensors with model.safetensors.index.json (`weight_map`, `metadata.total_size`), or one
  model.safetensors when everything fits one shard (what transformers itself writes), floating tensors in `dtype`;
- config.json with `torch_dtype` (and transformers 5's `dtype`) set to the export dtype;
- the tokenizer files and generation_config.json of the checkpoint (checkpoint.TOKENIZER_FILES).
`src` is a trainer checkpoint (run_dir/checkpoints/stepNNNNNNNN; a checkpoints folder means its newest one) or any
Hugging Face model directory. Two layouts are read, chosen by what is on disk:
- full weights in safetensors (a ddp checkpoint: save_pretrained's model.safetensors or its shards + index): each
  tensor is read at the offsets its file's header names, with one read into one buffer;
- a `sharded/` torch.distributed.checkpoint directory (an fsdp checkpoint, any world size): each tensor is
  assembled from its rank chunks by `dcp.load` into one buffer, without a process group;
- a LoRA checkpoint (trainer.lora: the adapter and the base's path and sha256, no base weights): each base tensor is
  read from the checked base model directory (or `base`) and merged with the adapter where its module is adapted,
  in fp32, then cast once (export_lora.py; `export_adapter` writes the PEFT adapter directory instead).
The tensor names and tied aliases come from the model built on the meta device from config.json (nothing
allocated): a tied lm_head is written once, under the embedding, as transformers does; a checkpoint that lacks a
tensor of the model or holds one it has not is refused before anything is written.

Why: the export used to build the whole model in fp32 in one process (4 bytes per parameter: 30 GB of host
memory for 7B, 131 GB for 32B) and wrote one fp32 file, where users deploy bf16 shards with an index.

How, and what it costs: the shard plan is made from the shapes alone, so each shard's safetensors header is
written first and every tensor is then read, cast and appended straight after it. Peak memory is one tensor in the
checkpoint's dtype plus its cast copy (no shard buffer, no model): for Qwen2.5-7B the embedding, 152064 x 3584,
2.2 GB in fp32 + 1.1 GB in bf16. The files are written under a hidden sibling `.OUT.export-partial` and renamed
to OUT at the end, so an export that is cut leaves no half-written OUT (a rerun removes the partial folder); with
`force` an existing OUT is replaced only once the new export is complete.

    areal-mq checkpoint export run/checkpoints/step00000040 OUT [--dtype bfloat16] [--max-shard-size 5GB] [--force]
    areal-mq checkpoint export LORA_CKPT OUT [--base DIR] [--adapter]
"""
from __future__ import annotations

import json
import re
import shutil
import struct
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from areal_mq.algorithms import export_lora
from areal_mq.algorithms.checkpoint import SHARDED, STATE_JSON, TOKENIZER_FILES, checkpoint_format, latest_checkpoint
from areal_mq.algorithms.export_sources import CODES, DcpSource, SafetensorsSource
from areal_mq.errors import ExportError

DTYPES = ("bfloat16", "float32")  # the export dtypes, bfloat16 first: the default
INDEX = "model.safetensors.index.json"
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20,
          "GIB": 2**30, "TIB": 2**40}


@dataclass
class Exported:
    """What `export_model` wrote."""

    out: Path
    dtype: str
    files: list[str]  # the weight files, in order
    tensors: int
    total_size: int  # bytes of tensor data (the index's metadata.total_size)
    source: str  # "safetensors", "dcp" or "lora" (merged with the adapter)


@dataclass
class _Tensor:
    name: str  # the Hugging Face name written
    shape: tuple[int, ...]
    dtype: Any  # torch dtype in the export
    read: Any  # () -> torch.Tensor in the checkpoint's dtype
    nbytes: int = field(init=False)

    def __post_init__(self) -> None:
        numel = 1
        for d in self.shape:
            numel *= d
        self.nbytes = numel * self.dtype.itemsize


def parse_size(text: str | int) -> int:
    """Bytes of a size such as "5GB" (10^9, as transformers counts), "2GiB" (2^30), "500MB" or a plain number."""
    if isinstance(text, int):
        size = text
    else:
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B?)\s*", str(text).upper())
        if not m or m.group(2) not in _UNITS:
            raise ExportError(f"max shard size {text!r} is not a size: write e.g. 5GB, 500MB or 2GiB")
        size = int(float(m.group(1)) * _UNITS[m.group(2)])
    if size <= 0:
        raise ExportError(f"max shard size {text!r} must be positive")
    return size


def resolve_source(src: str | Path) -> Path:
    """The checkpoint directory to export: `src` itself, or the newest checkpoint of a checkpoints folder."""
    src = Path(src)
    if not src.is_dir():
        raise ExportError(f"checkpoint {src} does not exist (pass run_dir/checkpoints/stepNNNNNNNN, or a Hugging Face "
                          "model directory)")
    if not (src / "config.json").is_file() and not (src / STATE_JSON).is_file():
        newest = latest_checkpoint(src)
        if newest is None:
            raise ExportError(f"{src} is neither a trainer checkpoint ({STATE_JSON}) nor a model directory "
                              "(config.json), and holds no stepNNNNNNNN checkpoint")
        src = newest
    if not (src / "config.json").is_file() and not export_lora.is_lora(src):
        raise ExportError(f"checkpoint {src} has no config.json: it cannot be exported (was it cut while written?)")
    return src


def export_model(src: str | Path, out: str | Path, dtype: str = "bfloat16", max_shard_size: str | int = "5GB",
                 force: bool = False, progress: bool = False, base: str | Path | None = None) -> Exported:
    """Write checkpoint `src` to `out` as sharded safetensors in `dtype` (module docstring); a LoRA checkpoint merged
    with its base (base_model.json's, or `base`). Every check runs before anything is written; an ExportError says
    what was wrong."""
    import torch

    if dtype not in DTYPES:
        raise ExportError(f"unknown export dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    limit = parse_size(max_shard_size)
    src = resolve_source(src)
    out = Path(out)
    _check_out(src, out, force)
    lora = export_lora.is_lora(src)
    if base is not None and not lora:
        raise ExportError(f"--base names the base model of a LoRA checkpoint; {src} holds full weights")
    model_dir = export_lora.checked_base(src, base) if lora else src  # config.json's directory
    source = export_lora.LoraSource(_open_source(model_dir), src) if lora else _open_source(src)
    with source:
        tensors = _match(model_dir, source, getattr(torch, dtype))
        shards = _plan(tensors, limit)
        tmp = out.parent / f".{out.name}.export-partial"
        shutil.rmtree(tmp, ignore_errors=True)  # a cut export's leftovers
        tmp.mkdir(parents=True)
        try:
            files = _write(tmp, shards, progress)
            _write_config(model_dir, tmp, dtype)
            for name in TOKENIZER_FILES:
                for where in (src, model_dir):  # a LoRA checkpoint holds its base's tokenizer files too
                    if (where / name).is_file() and not (tmp / name).exists():
                        shutil.copy2(where / name, tmp / name)
            _replace(tmp, out)
        except BaseException:  # a full disk, a bad read, Ctrl-C: nothing half-written stays behind
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return Exported(out, dtype, files, len(tensors), sum(t.nbytes for t in tensors), source.kind)


def _check_out(src: Path, out: Path, force: bool) -> None:
    if out.exists() and not out.is_dir():
        raise ExportError(f"output {out} exists and is a file; choose a directory")
    if out.is_dir() and any(out.iterdir()):
        if not force:
            raise ExportError(f"output {out} exists and is not empty; choose another directory, or pass --force to "
                              "replace it once the export is complete")
        s, o = src.resolve(), out.resolve()
        if s == o or o in s.parents:
            raise ExportError(f"output {out} holds the checkpoint {src}: --force would delete it; choose another")


def _replace(tmp: Path, out: Path) -> None:
    """Move the finished export into place; an existing OUT (forced, or empty) goes only after."""
    if out.exists():
        old = out.parent / f".{out.name}.export-old"
        shutil.rmtree(old, ignore_errors=True)
        out.rename(old)
        tmp.rename(out)
        shutil.rmtree(old, ignore_errors=True)
    else:
        tmp.rename(out)


def _expected(src: Path) -> tuple[list[str], set[str]]:
    """The model's state-dict names in order, tied aliases (lm_head tied to the embedding) apart, from the model built
    on the meta device."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        config = AutoConfig.from_pretrained(str(src), local_files_only=True)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    except (OSError, ValueError, KeyError) as exc:
        raise ExportError(f"cannot build the model of {src}/config.json: {exc}") from exc
    seen, names, aliases = set(), [], set()
    for name, t in model.state_dict(keep_vars=True).items():
        (aliases.add(name) if id(t) in seen else names.append(name))
        seen.add(id(t))
    return names, aliases


def _match(src: Path, source: Any, dtype: Any) -> list[_Tensor]:
    """One _Tensor per name of the model, read from `source`; refuse a checkpoint that does not fit the model."""
    names, aliases = _expected(src)
    have = set(source.names())
    missing = [n for n in names if n not in have]
    extra = sorted(have - set(names) - aliases)
    if missing or extra:
        raise ExportError(f"checkpoint {src} does not fit its config.json: missing {missing[:5]}, unexpected "
                          f"{extra[:5]}; was it written from another model?")
    out = []
    for name in names:
        shape, stored = source.meta(name)
        want = dtype if stored.is_floating_point else stored  # integer buffers keep their dtype
        out.append(_Tensor(name, shape, want, lambda name=name: source.read(name)))
    return out


def _plan(tensors: list[_Tensor], limit: int) -> list[list[_Tensor]]:
    """Consecutive tensors into shards of at most `limit` bytes; a larger tensor gets a shard of its own."""
    shards: list[list[_Tensor]] = [[]]
    size = 0
    for t in tensors:
        if shards[-1] and size + t.nbytes > limit:
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += t.nbytes
    return shards


def _write(tmp: Path, shards: list[list[_Tensor]], progress: bool) -> list[str]:
    from tqdm import tqdm

    n = len(shards)
    names = ["model.safetensors"] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    bar = tqdm(total=sum(len(s) for s in shards), unit="tensor", desc="export", file=sys.stderr,
               disable=None if progress else True)  # None: shown on a terminal only
    try:
        for fname, shard in zip(names, shards):
            _write_shard(tmp / fname, shard, bar)
    finally:
        bar.close()
    if n > 1:
        index = {"metadata": {"total_size": sum(t.nbytes for s in shards for t in s)},
                 "weight_map": {t.name: fname for fname, s in zip(names, shards) for t in s}}
        (tmp / INDEX).write_text(json.dumps(index, indent=2) + "\n")
    return names


def _write_shard(path: Path, shard: list[_Tensor], bar: Any) -> None:
    """A safetensors file: 8-byte little-endian header length, the JSON header (padded to 8 bytes), then each
    tensor's bytes at the offsets the header names, written one tensor at a time."""
    codes = {v: k for k, v in CODES.items()}
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for t in shard:
        header[t.name] = {"dtype": codes[str(t.dtype).removeprefix("torch.")], "shape": list(t.shape),
                          "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for t in shard:
            value = t.read()
            if tuple(value.shape) != t.shape:
                raise ExportError(f"{t.name}: the checkpoint holds shape {tuple(value.shape)}, its index {t.shape}")
            value = value.to(t.dtype).contiguous()
            written = f.write(_bytes(value))
            if written != t.nbytes:
                raise ExportError(f"{path}: wrote {written} of {t.nbytes} bytes of {t.name}")
            del value  # one tensor alive at a time
            bar.update(1)


def _bytes(t: Any) -> memoryview:
    """The tensor's bytes without a copy (bf16 has no numpy dtype: view as uint8 first)."""
    import torch

    flat = t.reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy() if flat.numel() else b"")


def _write_config(src: Path, tmp: Path, dtype: str) -> None:
    config = json.loads((src / "config.json").read_text())
    config["torch_dtype"] = dtype  # transformers 4 and vLLM read torch_dtype; transformers 5 writes dtype
    if "dtype" in config:
        config["dtype"] = dtype
    (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _open_source(src: Path) -> Any:
    """The reader of the checkpoint's model: its format as the checkpoint code names it (a model directory without
    a trainer's JSON is "hf")."""
    fmt = checkpoint_format(src) if (src / STATE_JSON).is_file() else "hf"
    if fmt == "dcp":
        if not (src / SHARDED / ".metadata").is_file():
            raise ExportError(f"checkpoint {src} is sharded but {SHARDED}/.metadata is missing (was it cut?)")
        return DcpSource(src / SHARDED)
    files = sorted(src.glob("*.safetensors"))
    if fmt != "hf" or not files:
        raise ExportError(f"checkpoint {src} holds no weights export reads (format {fmt!r}, no *.safetensors)")
    return SafetensorsSource(files)


def export_adapter(src: Path, out: Path, base: str | Path | None, dtype: str | None, force: bool) -> list[str]:
    """Write the PEFT adapter directory of LoRA checkpoint `src` into `out`; returns the files written."""
    import torch
    from safetensors.torch import save_file

    from areal_mq.algorithms.export_lora import (ADAPTER_CONFIG, adapter_config, checked_base, is_lora,
                                                 read_adapter)
    from areal_mq.algorithms.lora import ADAPTER_FILE, BASE_FILE, PEFT_PREFIX

    if dtype is not None and dtype not in DTYPES:
        raise ExportError(f"unknown export dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    if not is_lora(src):
        raise ExportError(f"checkpoint {src} holds no LoRA adapter ({ADAPTER_FILE} + {BASE_FILE}): --adapter "
                          "exports a trainer.lora checkpoint; export full weights without it")
    _check_out(src, out, force)
    path = checked_base(src, base)
    cfg = adapter_config(src)
    tensors = read_adapter(src)
    if dtype is not None:
        tensors = {k: v.to(getattr(torch, dtype)) for k, v in tensors.items()}
    cfg["base_model_name_or_path"] = str(path.resolve())
    tmp = out.parent / f".{out.name}.export-partial"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        save_file({PEFT_PREFIX + k: v.contiguous() for k, v in tensors.items()}, str(tmp / ADAPTER_FILE),
                  metadata={"format": "pt"})
        (tmp / ADAPTER_CONFIG).write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
        _replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return [ADAPTER_FILE, ADAPTER_CONFIG]
