"""DeviceGuard: a TorchDispatchMode that fails on device mistakes and host syncs, on a CPU-only machine.

What: every aten op run inside `with DeviceGuard():` has its tensor arguments checked; if they sit on more than
one device the op raises `DeviceMismatch` naming the op and the devices (0-dim CPU tensors are allowed beside
any device, as torch itself allows them). With `forbid_syncs=True` it also raises `HostSync` on the ops that
make the host wait for the device (`.item()`, `int(t)`, `bool(t)`, `.tolist()`, `nonzero`, a copy to the CPU).
Why: a plain run with the model on `meta` does not catch `F.embedding(cpu_index, meta_weight)` (meta absorbs it),
and the H100 run failed on exactly such mixes; this mode catches them on the CPU before a GPU sees them.
How: put the model on `meta` (or any second device), run the step under the guard:
    with DeviceGuard(forbid_syncs=True) as guard:
        engine_decode_step(...)
    assert guard.ops > 0
"""
from __future__ import annotations

from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class DeviceMismatch(RuntimeError):
    """An op received tensors on different devices."""


class HostSync(RuntimeError):
    """An op made the host wait for the device inside a region that must not."""


SYNC_OPS = {"_local_scalar_dense", "nonzero", "is_nonzero", "equal", "item", "_assert_async"}


class _TolistGuard(TorchFunctionMode):
    """`.tolist()` reads the data in C++ without dispatching an aten op, so the dispatch mode never sees it;
    it is caught one level up, where Tensor methods are called (on a device tensor: a CPU one needs no wait)."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if func is torch.Tensor.tolist and args and args[0].device.type != "cpu":
            raise HostSync(".tolist() makes the host wait for the device inside a region that must not sync")
        return func(*args, **(kwargs or {}))


class DeviceGuard(TorchDispatchMode):
    """Fail on an op mixing devices (and, optionally, on host syncs). `ops` counts the ops checked."""

    def __init__(self, forbid_syncs: bool = False, allow_cpu_scalars: bool = True) -> None:
        super().__init__()
        self.forbid_syncs = forbid_syncs
        self.allow_cpu_scalars = allow_cpu_scalars
        self.ops = 0
        self.seen_devices: set[str] = set()
        self._tolist = _TolistGuard() if forbid_syncs else None

    def __enter__(self) -> "DeviceGuard":
        super().__enter__()
        if self._tolist is not None:
            self._tolist.__enter__()
        return self

    def __exit__(self, *exc: Any) -> Any:
        if self._tolist is not None:
            self._tolist.__exit__(*exc)
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        self.ops += 1
        name = func.overloadpacket.__name__ if hasattr(func, "overloadpacket") else str(func)
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        devices = set()
        for t in tensors:
            if self.allow_cpu_scalars and t.device.type == "cpu" and t.dim() == 0:
                continue
            devices.add(str(t.device))
        self.seen_devices |= devices
        if len(devices) > 1:
            shapes = ", ".join(f"{tuple(t.shape)}@{t.device}" for t in tensors)
            raise DeviceMismatch(f"aten.{name} got tensors on {sorted(devices)}: {shapes}")
        if self.forbid_syncs:
            if name in SYNC_OPS:
                raise HostSync(f"aten.{name} makes the host wait for the device (.item(), int(), bool(), .tolist() "
                               "or nonzero) inside a region that must not sync")
            if name in ("_to_copy", "to", "copy_") and tensors:
                target = kwargs.get("device")
                if name == "copy_" and len(tensors) >= 2:
                    dst, src = tensors[0], tensors[1]
                    if dst.device.type == "cpu" and src.device.type != "cpu":
                        raise HostSync(f"aten.copy_ from {src.device} to the CPU inside a no-sync region")
                elif target is not None and torch.device(target).type == "cpu" and tensors[0].device.type != "cpu":
                    raise HostSync(f"aten.{name} to the CPU from {tensors[0].device} inside a no-sync region")
        return func(*args, **kwargs)
