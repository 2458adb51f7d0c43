"""DeviceGuard (areal_mq/testing/device_guard.py): fails on ops mixing devices and, if asked, on host syncs.
Run: pytest tests/unit/test_device_guard.py -q
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from areal_mq.testing.device_guard import DeviceGuard, DeviceMismatch, HostSync


def test_a_cpu_index_into_a_meta_weight_is_caught_where_meta_alone_absorbs_it():
    idx, weight = torch.tensor([[1, 2]]), torch.empty(10, 4, device="meta")
    assert F.embedding(idx, weight).device.type == "meta"  # no error without the guard: the blind spot
    with DeviceGuard(), pytest.raises(DeviceMismatch, match=r"aten\.embedding.*\['cpu', 'meta'\]"):
        F.embedding(idx, weight)


def test_ops_on_one_device_pass_and_are_counted():
    with DeviceGuard() as guard:
        a = torch.ones(3, device="meta")
        (a * 2 + a).sum()
    assert guard.ops >= 3 and guard.seen_devices == {"meta"}


def test_a_cpu_scalar_beside_another_device_is_allowed_unless_refused():
    x, scalar = torch.ones(3, device="meta"), torch.tensor(2.0)
    with DeviceGuard():
        assert (x * scalar).device.type == "meta"  # torch itself allows 0-dim CPU tensors anywhere
    with DeviceGuard(allow_cpu_scalars=False), pytest.raises(DeviceMismatch):
        x * scalar


def test_a_move_between_devices_is_not_a_mix():
    with DeviceGuard():
        assert torch.arange(4).to("meta").device.type == "meta"


def test_host_syncs_are_flagged_only_when_forbidden():
    x = torch.arange(4.0)
    with DeviceGuard():
        assert x.sum().item() == 6.0
    for sync in (lambda: x.sum().item(), lambda: bool(x.any()), lambda: x.nonzero()):
        with DeviceGuard(forbid_syncs=True), pytest.raises(HostSync):
            sync()


def test_tolist_of_a_device_tensor_is_a_host_sync_and_of_a_cpu_tensor_is_not():
    """.tolist() dispatches no aten op: the guard catches it at the Tensor-method level."""
    with DeviceGuard(forbid_syncs=True), pytest.raises(HostSync, match="tolist"):
        torch.ones(2, device="meta").tolist()
    with DeviceGuard(forbid_syncs=True):
        assert torch.arange(3).tolist() == [0, 1, 2]  # host data: nothing to wait for


def test_a_copy_back_to_the_cpu_is_a_host_sync():
    x = torch.ones(2, device="meta")
    with DeviceGuard(forbid_syncs=True), pytest.raises(HostSync, match="to the CPU"):
        x.to("cpu")


def test_the_guard_covers_backward():
    w = torch.ones(3, device="meta", requires_grad=True)
    idx = torch.tensor([0, 1])
    with DeviceGuard(), pytest.raises(DeviceMismatch):
        w[idx].sum().backward()  # the CPU index meets the meta weight in the forward (index) already
    with DeviceGuard() as guard:
        (w * 2).sum().backward()
    assert guard.ops > 3 and w.grad.device.type == "meta"
