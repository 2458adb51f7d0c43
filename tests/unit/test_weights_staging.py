"""A rank's publish snapshot staged to host memory in bounded buckets (areal_mq/weights/staging.py): the same bytes as
the plain cast copy, packed into buffers of the bucket's size (one of its own for a larger tensor), copied a bounded
piece at a time, in the caller's order. The accelerator path's pieces and buffers are exercised on CPU tensors here
(the packing and the piecewise cast do not depend on the device); on a machine without CUDA nothing is pinned.
Run: pytest tests/unit/test_weights_staging.py"""
from __future__ import annotations

import pytest
import torch

from areal_mq.weights import staging


def _parts() -> list[tuple[str, torch.Tensor, torch.dtype]]:
    g = torch.Generator().manual_seed(0)
    return [("embed", torch.randn(37, 24, generator=g), torch.bfloat16),  # 1,776 bytes in bf16: over a bucket
            ("bias", torch.randn(24, generator=g), torch.bfloat16),
            ("norm", torch.randn(24, generator=g), torch.float32),
            ("step", torch.tensor(7), torch.int64),  # 0-dim, not floating: kept as it is
            ("wide", torch.randn(6, 40, generator=g)[:, ::2], torch.float16)]  # not contiguous


def test_the_cpu_snapshot_is_the_plain_cast_copy_in_the_callers_order():
    parts = _parts()
    out = staging.stage_to_host(parts)
    assert list(out) == [p[0] for p in parts]
    for name, t, dtype in parts:
        assert out[name].dtype == dtype and torch.equal(out[name], t.to(dtype)), name
        assert out[name].untyped_storage().data_ptr() != t.untyped_storage().data_ptr()  # a copy


def test_the_bucketed_path_packs_into_buffers_of_the_bucket_size_and_copies_the_same_bytes():
    parts, bucket = _parts(), 1024
    hosts = staging._place(parts, bucket, pin=False)
    for host, (name, t, dtype) in zip(hosts, parts):
        staging._copy_in_pieces(host, t, bucket)
        assert host.dtype == dtype and host.shape == t.shape and torch.equal(host, t.to(dtype)), name
        assert host.storage_offset() * host.element_size() % staging.ALIGN == 0
    sizes = {h.untyped_storage().data_ptr(): h.untyped_storage().nbytes() for h in hosts}
    # embed has its own buffer; bias (0) and norm (512) share a bucket; step would start at 1,024: a new one, with wide
    assert sorted(sizes.values()) == [bucket, bucket, 37 * 24 * 2]
    ptr = [h.untyped_storage().data_ptr() for h in hosts]
    assert ptr[1] == ptr[2] != ptr[3] == ptr[4] and [h.storage_offset() * h.element_size() for h in hosts[1:]] == [
        0, 512, 0, 512]


def test_pieces_never_exceed_the_bucket(monkeypatch):
    seen = []
    real = torch.Tensor.copy_

    def spy(self, src, non_blocking=False):
        seen.append(src.numel() * max(src.element_size(), self.element_size()))
        return real(self, src, non_blocking=non_blocking)

    t = torch.randn(100, 16)  # 64 bytes a row in fp32
    host = torch.empty(100, 16, dtype=torch.bfloat16)
    monkeypatch.setattr(torch.Tensor, "copy_", spy)
    staging._copy_in_pieces(host, t, 640)
    monkeypatch.undo()
    assert len(seen) == 10 and max(seen) <= 640 and torch.equal(host, t.to(torch.bfloat16))


def test_nothing_is_pinned_without_cuda_and_a_bad_bucket_is_refused():
    if not torch.cuda.is_available():
        assert staging.pinned_available() is False
    with pytest.raises(ValueError, match="bucket_bytes"):
        staging.stage_to_host(_parts(), 0)


@pytest.mark.gpu
def test_on_cuda_the_snapshot_is_pinned_host_memory_and_the_device_holds_one_piece_at_a_time():
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    parts = [(f"w{i}", torch.randn(1024, 1024, device=dev, generator=g), torch.bfloat16) for i in range(8)]
    parts.append(("step", torch.tensor(3, device=dev), torch.int64))
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    out = staging.stage_to_host(parts, bucket_bytes=1 << 20)  # a 4 MiB fp32 weight in 1 MiB pieces
    assert torch.cuda.max_memory_allocated() - before <= 1 << 20
    assert list(out) == [p[0] for p in parts]
    for name, t, dtype in parts:
        assert out[name].device.type == "cpu" and out[name].is_pinned(), name
        assert torch.equal(out[name], t.to(dtype).cpu()), name
