"""One device setting for the whole system: `model.device` (auto | cpu | cuda | cuda:N), overridable per role.

What: `check_device_spec(spec)` validates the string (configs call it, so a typo is a ConfigError before any
process starts); `resolve_device(spec)` turns it into a `torch.device` (auto = cuda:0 when CUDA is available,
else cpu; asking for cuda where there is none is a ConfigError naming what torch sees). `role_device(cfg, role)`
is the device a role runs on: the role's own override (`rollout.device`, `trainer.device`) else `model.device`.
Why one place: the engine, the trainer, checkpoints and the benchmarks must agree on the same rule, and a GPU
user should set it once. `meta` is accepted for tests only (the device-guard tests put the model there).
    python -c "from areal_mq.devices import resolve_device; print(resolve_device('auto'))"
"""
from __future__ import annotations

import re
from typing import Any

from areal_mq.errors import ConfigError

DEVICE_RE = re.compile(r"^(auto|cpu|meta|cuda(:\d+)?)$")


def check_device_spec(spec: str) -> str:
    """Return `spec` if it names a device this system understands, else raise ConfigError saying what does."""
    if not isinstance(spec, str) or not DEVICE_RE.match(spec):
        raise ConfigError(f"device {spec!r} is not one of auto, cpu, cuda, cuda:N")
    return spec


def resolves_to_cuda(spec: str | None = "auto") -> bool:
    """Whether `resolve_device(spec)` is a CUDA device, without importing torch where the answer is plain: cpu and
    meta are not, cuda[:N] is (resolve_device refuses it where there is none), and `auto` is not on a host without
    a GPU's device node (/dev/nvidia*, ROCm's /dev/kfd): `plan`'s check in the launcher asks this beside the
    children it starts, where importing torch costs seconds of CPU (issue 58)."""
    import glob

    spec = check_device_spec(spec or "auto")
    if spec in ("cpu", "meta"):
        return False
    if spec.startswith("cuda"):
        return True
    if not glob.glob("/dev/nvidia[0-9]*") and not glob.glob("/dev/kfd"):
        return False
    return resolve_device(spec).type == "cuda"


def resolve_device(spec: str | None = "auto") -> Any:
    """`auto` -> cuda:0 if CUDA is usable else cpu; `cuda`/`cuda:N` checked against what torch sees."""
    import torch

    spec = check_device_spec(spec or "auto")
    if spec == "auto":
        return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(spec)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"device {spec!r} asked for, but torch sees no CUDA device "
                              f"(torch {torch.__version__}, CUDA build: {torch.version.cuda}); use device: cpu or auto")
        index = device.index or 0
        if index >= torch.cuda.device_count():
            raise ConfigError(f"device {spec!r} asked for, but torch sees {torch.cuda.device_count()} CUDA device(s)")
        device = torch.device("cuda", index)
    return device


def role_device(cfg: Any, role: str) -> str:
    """The device spec a role runs on: its own section's `device` when set, else `model.device`."""
    section = getattr(cfg, role, None)
    override = getattr(section, "device", None)
    return override or cfg.model.device


def release_device_memory() -> None:
    """Give back what a finished in-process job (the launcher's base evaluation) left in CUDA's caching
    allocator, so the processes the run starts next see the memory free; nothing where CUDA was never used."""
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
