"""The chunk codec of a weight update: tensors <-> raw little-endian bytes, grouped into WeightsChunk messages.

What: `tensor_bytes` / `bytes_tensor` (raw storage both ways, dtype and size checked), `make_chunks` (a full version,
each tensor with its checksum), `make_delta_chunks` / `chunk_deltas` (a version as deltas from the previous one;
the delta codec itself is weights/delta.py), `same_layout` (whether a delta between two snapshots is possible) and
`unique_tensors` (the detached copies a trainer publishes, tied duplicates dropped as save_pretrained does). Several
tensors travel per chunk up to `chunk_bytes`; a tensor is never split. Frames are built only by areal_mq.protocol.
Used by server.py, client.py and publisher.py; tests in tests/unit/test_weights.py.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping

import numpy as np

from areal_mq.errors import WeightsFetchError
from areal_mq.messages import WeightsChunk
from areal_mq.weights.delta import DeltaError, TensorDelta

if TYPE_CHECKING:
    import torch

DTYPES = ("bfloat16", "float16", "float32", "float64", "int64", "int32", "uint8", "bool")


def tensor_bytes(t: "torch.Tensor") -> np.ndarray:
    """The raw storage of `t` as a 1-d uint8 array (no copy for a contiguous CPU tensor)."""
    import torch

    flat = t.detach().cpu().contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy()


def bytes_tensor(buf: np.ndarray, dtype: str, shape: list[int]) -> "torch.Tensor":
    """Inverse of tensor_bytes (copies: received frames are read-only)."""
    import torch

    if dtype not in DTYPES:
        raise WeightsFetchError(f"tensor dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    want = getattr(torch, dtype)
    expect = int(np.prod(shape, dtype=np.int64)) * torch.empty((), dtype=want).element_size()
    if buf.nbytes != expect:
        raise WeightsFetchError(f"tensor of {dtype}{list(shape)} needs {expect} bytes, got {buf.nbytes}")
    return torch.from_numpy(np.array(buf, dtype=np.uint8, copy=True)).view(want).reshape(shape)


def _groups(sizes: list[int], chunk_bytes: int) -> list[list[int]]:
    """Indices grouped in order into chunks of about `chunk_bytes`; a larger item travels alone."""
    groups: list[list[int]] = [[]]
    size = 0
    for i, n in enumerate(sizes):
        if groups[-1] and size + n > chunk_bytes:
            groups.append([])
            size = 0
        groups[-1].append(i)
        size += n
    return groups


def make_chunks(version: int, tensors: Mapping[str, "torch.Tensor"], chunk_bytes: int,
                digests: Mapping[str, str] | None = None) -> list[WeightsChunk]:
    """Full chunks of `version` (with each tensor's checksum when `digests` are given)."""
    items = list(tensors.items())
    groups = _groups([t.numel() * t.element_size() for _, t in items], chunk_bytes)
    return [WeightsChunk(
        version=version, index=i, total=len(groups), names=[items[j][0] for j in g],
        dtypes=[str(items[j][1].dtype).removeprefix("torch.") for j in g],
        shapes=[list(items[j][1].shape) for j in g], tensors=[tensor_bytes(items[j][1]) for j in g],
        checksums=[digests[items[j][0]] for j in g] if digests else []) for i, g in enumerate(groups)]


def make_delta_chunks(version: int, base: int, deltas: list[TensorDelta], chunk_bytes: int) -> list[WeightsChunk]:
    """Chunks of the delta base -> version (payloads in `tensors`, see messages.WeightsChunk)."""
    groups = _groups([d.nbytes for d in deltas], chunk_bytes)
    return [WeightsChunk(
        version=version, index=i, total=len(groups), base=base, names=[deltas[j].name for j in g],
        dtypes=[deltas[j].dtype for j in g], shapes=[deltas[j].shape for j in g],
        tensors=[deltas[j].payload for j in g], encodings=[deltas[j].encoding for j in g],
        counts=[deltas[j].count for j in g], checksums=[deltas[j].checksum for j in g])
        for i, g in enumerate(groups)]


def chunk_deltas(chunk: WeightsChunk) -> list[TensorDelta]:
    if chunk.base < 0 or not chunk.encodings or not chunk.checksums:
        raise DeltaError("corrupt", f"chunk {chunk.index} of version {chunk.version} is not a delta chunk")
    counts = chunk.counts or [0] * len(chunk.names)
    return [TensorDelta(*fields) for fields in zip(chunk.names, chunk.dtypes, chunk.shapes, chunk.encodings,
                                                   counts, chunk.checksums, chunk.tensors)]


def same_layout(a: Mapping[str, "torch.Tensor"], b: Mapping[str, "torch.Tensor"]) -> bool:
    """Same names in the same order, dtypes and shapes: a delta from `a` to `b` is possible."""
    return list(a) == list(b) and all(a[k].dtype == b[k].dtype and a[k].shape == b[k].shape for k in a)


def unique_tensors(tensors: Mapping[str, "torch.Tensor"], dtype: str | None = None) -> dict[str, "torch.Tensor"]:
    """Detached CPU copies in `dtype`, one per storage: tied parameters (lm_head == embed_tokens) are sent
    once under their first name (safetensors refuses shared memory; engines accept either name).
    Always copies, even when the dtype already matches: the zmq server serves these tensors later, and
    live parameters would change under a reader while the next step trains."""
    import torch

    out: dict[str, Any] = {}
    seen: set[tuple[int, int]] = set()
    for name, t in tensors.items():
        key = (t.untyped_storage().data_ptr(), t.storage_offset())
        if key in seen:
            continue
        seen.add(key)
        want = getattr(torch, dtype) if dtype is not None else t.dtype
        out[name] = t.detach().to(device="cpu", dtype=want, copy=True).contiguous()
    return out
