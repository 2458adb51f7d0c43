"""Lossless, checksummed weight deltas: version N as a small patch on version N-1 as published.

What:
- `checksum(t)`: blake2b-128 (hex) of a tensor's raw little-endian bytes — the identity of a published tensor.
- `encode(base, new)` -> TensorDelta: for one tensor (same dtype and shape as its base) the smaller of
    "sparse": the changed element positions (gaps between them, uint32, or uint64 past 2**32 elements)
              followed by the new elements' raw bits, or
    "xor":    the XOR of the two tensors' raw bytes (mostly zero bytes at RL learning rates),
  each compressed with zstd, plus the checksum of `new`. Elements are compared by their bits, so NaN,
  -0.0 and every dtype round-trip exactly. Tensors on an accelerator are compared there (torch: compare, positions,
  gaps, xor); only the changed positions and values, and a dense change's xor, come to the host for zstd. CPU
  tensors are compared by numpy over zero-copy views, on one thread. Either way the full-size xor is tried only
  for a dense change (XOR_DENSITY): at RL learning rates the sparse frame is within a few percent of it and the
  xor's compression was most of the encode time.
- `apply(base, delta)` -> the new tensor (a fresh tensor: `base` is never written), refused with DeltaError
  when the delta does not fit its base (name, dtype, shape), its payload is corrupt, or the result's
  checksum differs from the one the trainer published.
- `encode_version(base, new)` / `apply_version(base, deltas)`: the same over a whole state dict; the
  version's names must be exactly the base's.
Why: at RL learning rates only a few percent of bf16 values change per step, so a delta is a few percent of
the full bytes; the checksum makes "the receiver holds exactly what the trainer published" a proof, not a hope.
Bounds (a hostile or broken peer): a sparse delta declares its count, and its decompressed size
count * (gap + element bytes) must be below the tensor's size; an xor delta decompresses to exactly the
tensor's size; the zstd frame's declared content size is checked before anything is allocated. So decoding
never allocates more than the declared (base-checked) tensor size.
The wire and file layout are in docs/protocol.md ("Weight deltas").

How to run: tests/unit/test_weights_delta.py.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping

import numpy as np

from areal_mq.errors import WeightsFetchError

if TYPE_CHECKING:
    import torch

ENCODINGS = ("sparse", "xor")
CHECKSUM = "blake2b-128"
ZSTD_LEVEL = 3
XOR_DENSITY = 0.25  # the xor frame is tried only when the raw sparse size is at least this share of the bytes
_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


class DeltaError(WeightsFetchError):
    """A delta that cannot be applied. `reason` is one of: checksum (the result is not what the trainer
    published), corrupt (undecodable payload or fields), missing (a piece of the chain is gone),
    base (the receiver does not hold the delta's base). The receiver then fetches the full version."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


@dataclass
class TensorDelta:
    """One tensor's delta. payload  # [P] uint8, a zstd frame; count: changed elements (sparse) or 0 (xor)."""

    name: str
    dtype: str
    shape: list[int]
    encoding: str
    count: int
    checksum: str
    payload: np.ndarray

    @property
    def nbytes(self) -> int:
        return int(self.payload.nbytes)


# ---------------------------------------------------------------- raw views
def _host_bits(t: "torch.Tensor") -> np.ndarray:
    """A 1-d integer tensor's raw bits on the host, as numpy unsigned integers of its element size."""
    flat = t.detach().cpu().contiguous()
    return flat.numpy().view(_UINT[flat.element_size()])


def _device_bits(t: "torch.Tensor") -> "torch.Tensor":
    """`t`'s raw bits as a 1-d signed integer tensor of its element size, on its own device (a view, no copy)."""
    import torch

    flat = t.detach().contiguous().reshape(-1)
    if flat.dtype == torch.bool:
        flat = flat.view(torch.uint8)
    return flat.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[flat.element_size()])


def raw(t: "torch.Tensor") -> np.ndarray:
    """The raw storage of `t` as 1-d unsigned integers of its element size (no copy for a contiguous CPU tensor)."""
    return _host_bits(_device_bits(t))


def checksum(t: "torch.Tensor") -> str:
    return hashlib.blake2b(memoryview(raw(t)).cast("B"), digest_size=16).hexdigest()


def _dtype_name(t: "torch.Tensor") -> str:
    return str(t.dtype).removeprefix("torch.")


def _gap_dtype(numel: int) -> Any:
    return np.uint32 if numel < 2 ** 32 else np.uint64


# ---------------------------------------------------------------- encode
def _worth_trying(changed: int, numel: int, esize: int) -> tuple[bool, bool]:
    """(sparse, xor): which encodings to build for `changed` of `numel` elements of `esize` bytes. Sparse while its
    raw size is under the tensor's; xor only for a dense change (raw sparse size >= XOR_DENSITY of the bytes) or
    when sparse is out; at least one of them."""
    nbytes = numel * esize
    sparse_raw = changed * (np.dtype(_gap_dtype(numel)).itemsize + esize)
    sparse = sparse_raw < nbytes or nbytes == 0
    return sparse, not sparse or sparse_raw >= XOR_DENSITY * nbytes


def _candidates_numpy(base: "torch.Tensor", new: "torch.Tensor", zc: Any) -> list[tuple[str, int, bytes]]:
    """The encodings worth trying, compared on the host: numpy over zero-copy views of CPU tensors, one thread,
    so a publish beside the next training step does not take the step's torch threads."""
    a, b = raw(base), raw(new)
    changed = np.flatnonzero(a != b)
    gaps = _gap_dtype(a.size)
    sparse, xor = _worth_trying(changed.size, a.size, a.itemsize)
    out = []
    if sparse:
        step = np.diff(changed, prepend=0).astype(gaps)  # first: its position; then gaps (>= 1)
        out.append(("sparse", int(changed.size), zc.compress(step.tobytes() + b[changed].tobytes())))
    if xor:
        out.append(("xor", 0, zc.compress(np.bitwise_xor(a, b).tobytes())))
    return out


def _candidates_device(base: "torch.Tensor", new: "torch.Tensor", zc: Any) -> list[tuple[str, int, bytes]]:
    """The same encodings with the compare, the positions, the gaps and the xor computed by torch on the tensors'
    device (a trainer rank's GPU): only the changed positions and values cross to the host, and the full-size xor
    only when the change is dense enough for it to have a chance (the raw sparse size at least XOR_DENSITY of the
    tensor's bytes; below it the sparse frame measured within ~4-8 % of the xor one, and compressing the
    full-size xor was most of the encode: `python benchmarks/speed/weights.py --codec`)."""
    import torch

    a, b = _device_bits(base), _device_bits(new)
    changed = torch.nonzero(a != b).reshape(-1)
    gaps = _gap_dtype(a.numel())
    sparse, xor = _worth_trying(changed.numel(), a.numel(), a.element_size())
    out = []
    if sparse:
        step = torch.diff(changed, prepend=changed.new_zeros(1)).cpu().numpy().astype(gaps)
        out.append(("sparse", int(changed.numel()), zc.compress(step.tobytes() + _host_bits(b[changed]).tobytes())))
    if xor:
        out.append(("xor", 0, zc.compress(_host_bits(torch.bitwise_xor(a, b)).tobytes())))
    return out


def encode(name: str, base: "torch.Tensor", new: "torch.Tensor", digest: str | None = None,
           level: int = ZSTD_LEVEL, on_device: bool | None = None) -> TensorDelta:
    """The smaller (compressed) of the sparse and xor deltas taking `base` to `new` (same dtype and shape).
    on_device: diff with torch where the tensors live (default: when they are not on the CPU) instead of numpy on
    the host; both give frames any receiver applies the same way."""
    import zstandard

    if base.dtype != new.dtype or tuple(base.shape) != tuple(new.shape):
        raise ValueError(f"{name}: a delta needs the same dtype and shape, got {base.dtype}{list(base.shape)} "
                         f"-> {new.dtype}{list(new.shape)}; publish a full version instead")
    if on_device is None:
        on_device = new.device.type != "cpu"
    if on_device and base.device != new.device:
        raise ValueError(f"{name}: a device delta needs both versions on one device, got {base.device} and "
                         f"{new.device}")
    zc = zstandard.ZstdCompressor(level=level, write_checksum=True)
    found = (_candidates_device if on_device else _candidates_numpy)(base, new, zc)
    encoding, count, payload = min(found, key=lambda c: len(c[2]))
    return TensorDelta(name, _dtype_name(new), list(new.shape), encoding, count, digest or checksum(new),
                       np.frombuffer(payload, dtype=np.uint8))


def encode_version(base: Mapping[str, "torch.Tensor"], new: Mapping[str, "torch.Tensor"],
                   digests: Mapping[str, str] | None = None) -> list[TensorDelta]:
    """Deltas of every tensor of `new` against `base` (same names, dtypes and shapes, else ValueError)."""
    if list(base) != list(new):
        raise ValueError(f"a delta needs the same tensors: base has {len(base)}, new {len(new)} "
                         f"(e.g. {sorted(set(base) ^ set(new))[:3]})")
    return [encode(k, base[k], t, (digests or {}).get(k)) for k, t in new.items()]


# ---------------------------------------------------------------- apply
def _decompress(d: TensorDelta, size: int) -> bytes:
    import zstandard

    frame = np.ascontiguousarray(d.payload, dtype=np.uint8).tobytes()
    try:
        declared = zstandard.frame_content_size(frame)
        if declared not in (-1, size):
            raise DeltaError("corrupt", f"{d.name}: delta frame declares {declared} bytes, expected {size}")
        out = zstandard.ZstdDecompressor().decompress(frame, max_output_size=size)
    except zstandard.ZstdError as exc:
        raise DeltaError("corrupt", f"{d.name}: delta payload does not decompress: {exc}") from None
    if len(out) != size:
        raise DeltaError("corrupt", f"{d.name}: delta payload holds {len(out)} bytes, expected {size}")
    return out


def _check_fits(base: "torch.Tensor", d: TensorDelta) -> None:
    if d.encoding not in ENCODINGS:
        raise DeltaError("corrupt", f"{d.name}: unknown delta encoding {d.encoding!r} (known: {', '.join(ENCODINGS)})")
    if d.dtype != _dtype_name(base) or list(d.shape) != list(base.shape):
        raise DeltaError("base", f"{d.name}: delta is for {d.dtype}{list(d.shape)}, the base is "
                                 f"{_dtype_name(base)}{list(base.shape)}")


def apply(base: "torch.Tensor", d: TensorDelta) -> "torch.Tensor":
    """`base` patched by `d`, as a new tensor whose checksum is verified (DeltaError otherwise)."""
    import torch

    _check_fits(base, d)
    a = raw(base)
    if d.encoding == "xor":
        if d.count != 0:
            raise DeltaError("corrupt", f"{d.name}: an xor delta has count 0, got {d.count}")
        out = np.bitwise_xor(a, np.frombuffer(_decompress(d, a.nbytes), dtype=a.dtype))
    else:
        gaps = np.dtype(_gap_dtype(a.size))
        need = d.count * (gaps.itemsize + a.itemsize)
        if not 0 <= d.count <= a.size or (need >= a.nbytes and a.nbytes):
            raise DeltaError("corrupt", f"{d.name}: a sparse delta of {d.count} elements does not fit a tensor "
                                        f"of {a.size} ({need} >= {a.nbytes} bytes)")
        body = _decompress(d, need)
        split = d.count * gaps.itemsize
        step = np.frombuffer(body[:split], dtype=gaps).astype(np.int64)
        if d.count and ((step[1:] < 1).any() or step.sum() >= a.size):
            raise DeltaError("corrupt", f"{d.name}: sparse delta positions are not increasing inside {a.size}")
        out = a.copy()
        out[np.cumsum(step)] = np.frombuffer(body[split:], dtype=a.dtype)
    result = torch.from_numpy(out.view(np.uint8)).view(base.dtype).reshape(base.shape)
    if checksum(result) != d.checksum:
        raise DeltaError("checksum", f"{d.name}: the patched tensor's {CHECKSUM} differs from the published one; "
                                     "the delta or its base is not what the trainer published")
    return result


def apply_version(base: Mapping[str, "torch.Tensor"], deltas: list[TensorDelta]) -> dict[str, "torch.Tensor"]:
    """Every tensor of the next version: `base` patched by `deltas` (exactly one per base tensor)."""
    names = [d.name for d in deltas]
    if sorted(names) != sorted(base) or len(set(names)) != len(names):
        raise DeltaError("base", f"the delta covers {len(names)} tensors, the held weights have {len(base)} "
                                 f"(e.g. {sorted(set(names) ^ set(base))[:3]})")
    return {d.name: apply(base[d.name], d) for d in deltas}


def changed_elements(old: Mapping[str, "torch.Tensor"], new: Mapping[str, "torch.Tensor"]) -> dict[str, tuple]:
    """name -> (flat positions, new values) of every element whose bits differ between two versions of the same
    tensors (bits, so NaN and -0.0 count exactly): what an engine that holds `old` writes to reach `new`
    (Engine.update_weights(patches=...)). Raises DeltaError when the two do not have the same tensors."""
    import torch

    if old.keys() != new.keys():
        raise DeltaError("base", f"the held weights and the new version name different tensors "
                                 f"({sorted(set(old) ^ set(new))[:5]})")
    out = {}
    for name, value in new.items():
        before = old[name]
        if before.shape != value.shape or before.dtype != value.dtype:
            raise DeltaError("base", f"{name}: held {before.dtype} {list(before.shape)}, new {value.dtype} "
                                     f"{list(value.shape)}")
        positions = np.flatnonzero(raw(before) != raw(value))
        if positions.size:
            out[name] = (torch.from_numpy(positions.astype(np.int64)),
                         value.detach().reshape(-1)[torch.from_numpy(positions.astype(np.int64))])
    return out


def verify(tensors: Mapping[str, "torch.Tensor"], digests: Mapping[str, str]) -> None:
    """DeltaError("checksum") unless every tensor of a full version has its published checksum."""
    bad = [k for k, t in tensors.items() if k in digests and checksum(t) != digests[k]]
    if bad or set(digests) - set(tensors):
        raise DeltaError("checksum", f"{len(bad)} tensors differ from the published checksums (e.g. {bad[:3]}) "
                                     f"or are missing ({sorted(set(digests) - set(tensors))[:3]})")
