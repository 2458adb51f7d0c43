"""A trainer rank's publish snapshot, staged into host memory in bounded buckets instead of a device copy.

What: `stage_to_host(parts, bucket_bytes)` takes (name, tensor, dtype) triples (a rank's own slices of the policy,
algorithms/fsdp.py local_slices) and returns {name: host tensor in dtype}, a copy nobody else holds (the next
optimizer step cannot change it). On a CPU device it is the plain copy it always was. On an accelerator each
tensor is cast on its device and copied to the host a piece at a time, no piece over `bucket_bytes`
(PUBLISH_BUCKET_BYTES), into host buffers of `bucket_bytes` each (a tensor larger than one gets a buffer of its
own) that are page-locked where CUDA is (`pin_memory`: the copies run at the link's speed and without a bounce
buffer); the call returns once the copies are done (one wait on the device's current stream, which also orders
them after the optimizer step that made the weights).
Why: the snapshot was a device copy of the rank's shard in trainer.publish_dtype, and BackgroundPublisher keeps
2 alive while one is published and the next is taken, so 2 shards of device memory went to publishing (15.3 GiB a
rank for Qwen2.5-32B over 8 ranks in bf16), and the weight server kept a third as the next delta's base. Staged
here, the device holds one cast piece at a time (at most `bucket_bytes`), the 2 snapshots and the delta's base are
host memory (launch/plan.py counts them off the device), and the published bytes are the same (the same cast of
the same rows). The cost: the step waits for the device-to-host copy (a shard at the host link's speed, pinned)
where it used to wait for a device copy, and the delta against the previous version is computed on the host.
Host memory: what the publish's own host copies took before (the server serves these tensors as they are and keeps
trainer.keep_weight_versions of them, and the previous one as the delta's base), now page-locked where CUDA is;
torch's pinned-memory cache keeps a freed buffer for the next snapshot instead of registering pages again.
Run: tests/unit/weights/test_staging.py; tests/integration/test_sharded_weights.py publishes through it.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Iterable

if TYPE_CHECKING:
    import torch

PUBLISH_BUCKET_BYTES = 256 << 20  # a piece cast on the device and a pinned host buffer; a power of two: torch's
# pinned-memory cache rounds a request up to one, so buffers of this size waste nothing
ALIGN = 512  # every tensor starts at a multiple of this in its buffer (any dtype's alignment)


def pinned_available() -> bool:
    """Page-locked host memory needs CUDA: on a CPU-only build `torch.empty(pin_memory=True)` raises."""
    import torch

    return torch.cuda.is_available()


def stage_to_host(parts: Iterable[tuple[str, "torch.Tensor", "torch.dtype"]],
                  bucket_bytes: int = PUBLISH_BUCKET_BYTES) -> dict[str, "torch.Tensor"]:
    """{name: a host copy of the tensor in its dtype} (see the module docstring); tensors already on the CPU are
    copied as they are (cast where asked)."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    parts = [(name, t.detach(), dtype) for name, t, dtype in parts]
    out: dict[str, torch.Tensor] = {}
    remote = [p for p in parts if p[1].device.type != "cpu"]
    for name, t, dtype in parts:
        if t.device.type == "cpu":
            out[name] = t.to(dtype=dtype, copy=True).contiguous()
    if remote:
        for (name, t, _), host in zip(remote, _place(remote, bucket_bytes, pin=pinned_available())):
            _copy_in_pieces(host, t, bucket_bytes)
            out[name] = host
        _wait(remote[0][1].device)
    return {name: out[name] for name, _, _ in parts}  # the caller's order


def _place(remote: list, bucket_bytes: int, pin: bool) -> list["torch.Tensor"]:
    """Host tensors for `remote`'s (name, tensor, dtype), packed in order into buffers of `bucket_bytes` (one of
    its own for a tensor larger than that)."""
    import torch

    def buffer(nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)

    views: list[torch.Tensor] = []
    current, used = None, 0
    for _, t, dtype in remote:
        nbytes = t.numel() * dtype.itemsize
        if nbytes > bucket_bytes:
            views.append(buffer(nbytes).view(dtype).view(t.shape))
            continue
        at = -(-used // ALIGN) * ALIGN
        if current is None or at + nbytes > bucket_bytes:
            current, at = buffer(bucket_bytes), 0
        views.append(current[at:at + nbytes].view(dtype).view(t.shape))
        used = at + nbytes
    return views


def _copy_in_pieces(host: "torch.Tensor", t: "torch.Tensor", bucket_bytes: int) -> None:
    """`host` <- `t` cast to host.dtype, dim-0 pieces of at most `bucket_bytes` (in either dtype) at a time: the cast
    piece is the only device memory this takes. Non-blocking: `_wait` ends them."""
    if t.dim() == 0 or t.numel() == 0:
        host.copy_(t.to(host.dtype), non_blocking=True)
        return
    row = max(t[0].numel() * max(t.element_size(), host.element_size()), 1)
    step = max(1, bucket_bytes // row)
    for start in range(0, t.shape[0], step):
        piece = t[start:start + step]
        if piece.dtype != host.dtype or not piece.is_contiguous():
            piece = piece.to(host.dtype).contiguous()
        host[start:start + step].copy_(piece, non_blocking=True)


def _wait(device: "torch.device") -> None:
    """The non-blocking copies (queued on the device's current stream) are done: the host tensors hold the bytes."""
    import torch

    torch.accelerator.current_stream(device).synchronize()
