"""Where `areal-mq checkpoint export` reads a checkpoint's tensors from, one tensor at a time (export.py).

What: two readers with one face: `names()` (the Hugging Face names held), `meta(name)` (shape, torch dtype, read
from the index without touching data), `read(name)` (that one tensor, whole, in the checkpoint's dtype), used as a
context manager.
- `SafetensorsSource(files)`: full weights in safetensors, one file or shards (a ddp checkpoint, any model
  directory). Each file's header is parsed once; a tensor is read with one `readinto` at its offsets into a fresh
  buffer. Plain reads rather than a memory map: a mapped file's touched pages count in the process's resident
  memory until it is unmapped, so reading a 15 GB file through one map looks like a 15 GB process.
- `DcpSource(path)`: an fsdp checkpoint's `torch.distributed.checkpoint` directory (`model.lm.<name>` entries, a
  chunk per rank that held part of the tensor, beside the AdamW state, which is never read). `dcp.load` assembles
  one tensor from its chunks into one buffer, with `no_dist` (no process group); the metadata file is read once.
"""
from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

from areal_mq.errors import ExportError

# safetensors dtype codes (the format's own names) -> torch dtype names
CODES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64", "I32": "int32",
         "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool"}


class SafetensorsSource:
    kind = "safetensors"

    def __init__(self, files: list[Path]):
        import torch

        self.where: dict[str, tuple[Path, int, int, tuple[int, ...], Any]] = {}
        self._handles: dict[Path, Any] = {}
        for path in files:
            for name, (start, length, shape, code) in _header(path).items():
                if code not in CODES:
                    raise ExportError(f"{path}: tensor {name} has dtype {code}, which export does not read")
                self.where[name] = (path, start, length, shape, getattr(torch, CODES[code]))

    def names(self) -> list[str]:
        return list(self.where)

    def meta(self, name: str) -> tuple[tuple[int, ...], Any]:
        return self.where[name][3], self.where[name][4]

    def read(self, name: str) -> Any:
        import torch

        path, start, length, shape, dtype = self.where[name]
        value = torch.empty(shape, dtype=dtype)
        if length:
            f = self._handles.get(path) or self._handles.setdefault(path, open(path, "rb"))
            f.seek(start)
            got = f.readinto(memoryview(value.reshape(-1).view(torch.uint8).numpy()))
            if got != length:
                raise ExportError(f"{path} is cut short: {name} needs {length} bytes at {start}, read {got}")
        return value

    def __enter__(self) -> "SafetensorsSource":
        return self

    def __exit__(self, *exc: Any) -> None:
        for f in self._handles.values():
            f.close()
        self._handles.clear()


def _header(path: Path) -> dict[str, tuple[int, int, tuple[int, ...], str]]:
    """name -> (absolute byte offset, length, shape, dtype code) from a safetensors file's header."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        n = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
        if n < 2 or 8 + n > size:
            raise ExportError(f"{path} is not a safetensors file (its header length is wrong); was it cut?")
        try:
            header = json.loads(f.read(n))
        except ValueError as exc:
            raise ExportError(f"{path} is not a safetensors file (its header is not JSON: {exc})") from exc
    header.pop("__metadata__", None)
    out = {}
    for name, entry in header.items():
        start, end = entry["data_offsets"]
        if 8 + n + end > size:
            raise ExportError(f"{path} is cut short: {name} ends at byte {8 + n + end} of {size}")
        out[name] = (8 + n + start, end - start, tuple(entry["shape"]), entry["dtype"])
    return out


class DcpSource:
    kind = "dcp"

    def __init__(self, path: Path):
        from torch.distributed.checkpoint import FileSystemReader
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        class _OnceReader(FileSystemReader):  # dcp.load asks for the metadata on every call: read it once
            def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
                if not hasattr(self, "_metadata"):
                    self._metadata = super().read_metadata(*args, **kwargs)
                return self._metadata

        self.reader = _OnceReader(str(path))
        try:
            metadata = self.reader.read_metadata()
        except Exception as exc:  # a pickle cut short, a file from another torch
            raise ExportError(f"{path}/.metadata cannot be read: {exc}") from exc
        self.keys: dict[str, str] = {}
        self.tensors: dict[str, Any] = {}
        for key, md in metadata.state_dict_metadata.items():
            if key.startswith("model.") and isinstance(md, TensorStorageMetadata):
                name = key.removeprefix("model.").removeprefix("lm.")  # the trainer's PolicyLogprobs wraps `lm`
                self.keys[name], self.tensors[name] = key, md

    def names(self) -> list[str]:
        return list(self.keys)

    def meta(self, name: str) -> tuple[tuple[int, ...], Any]:
        md = self.tensors[name]
        return tuple(md.size), md.properties.dtype

    def read(self, name: str) -> Any:
        import warnings

        import torch
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

        shape, dtype = self.meta(name)
        value = torch.empty(shape, dtype=dtype)
        with warnings.catch_warnings():  # "torch.distributed is disabled ...": no process group is the intent
            warnings.simplefilter("ignore", UserWarning)
            dcp.load({self.keys[name]: value}, storage_reader=self.reader,
                     planner=DefaultLoadPlanner(allow_partial_load=True), no_dist=True)
        return value

    def __enter__(self) -> "DcpSource":
        return self

    def __exit__(self, *exc: Any) -> None:
        pass
