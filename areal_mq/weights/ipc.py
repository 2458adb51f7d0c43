"""Colocated weight updates (trainer.publish_mode: cuda_ipc): the trainer's new weights reach an engine on the same
device as one device-to-device copy, with no bytes over a socket or a disk.

What:
- `IpcPublisher(run_dir, dtype)` (trainer side): the first publish allocates a handle set, SLOTS persistent flat
  buffers on the parameters' device in the publish dtype, and describes it once in run_dir/ipc/<set_id>.json
  (mode 0600): each tensor's name, dtype, shape and byte offset, and how to open each buffer — on CUDA the CUDA IPC
  handles that torch's reductions use (`storage._share_cuda_()`), as plain fields; on the CPU a shared file
  run_dir/ipc/<set_id>.slots that both sides map (`torch.from_file(shared=True)`). Every publish copies the live
  parameters into the slot that does not hold the newest version, then returns
  WeightsReady(version=N, mode="cuda_ipc", ipc_set=<set_id>): "the shared buffers now hold version N".
- `IpcReceiver(run_dir)` (rollout side): `update(engine, ready)` opens the set named (once per set id), refuses
  what is not this run's, not this host's or device's, or does not fit the engine's parameters, then calls
  engine.update_weights(N, tensors=<views of N's slot>): the engine copies in place (its storages stay), and
  stamps tokens after it with N.

    trainer params ──copy──► slot s (seq odd … even, version N) ──WeightsReady(N, ipc_set)──► worker
    worker: seq, version of a slot holding N (or newer) ──► engine.update_weights (copy in place) ──► sync ──►
            seq again: unchanged = a whole version; changed = torn (the trainer reused the slot) → copy the newest

Invariants: a torn read is never kept — each slot carries a seqlock in a shared header run_dir/ipc/<set_id>.seq
(int64 [SLOTS, 2]: seq, version; odd seq = being written); with two slots the trainer overwrites the slot a worker
reads only after publishing again, and the worker then copies the newest whole version instead. Within one set
versions never go back (a resumed trainer is a new process and a new set). Nothing from the wire or the file is
unpickled: the description is JSON checked field by field, the CUDA storage is rebuilt with
torch.multiprocessing.reductions.rebuild_cuda_tensor from those fields and classes fixed here, and every path is
built here from the validated set id, under the run's ipc directory.
Why: on one GPU the trainer and the engine hold the same weights a few hundred MB apart; going through host memory
and a socket (zmq) or a file (disk) costs far more than the ~0.1 ms per 100 MB of a device copy.
On the CPU (tests, a CPU run with colocated roles) the same protocol runs on shared memory.

How to run: tests/unit/test_weights_ipc.py, tests/integration/test_weights_ipc.py (the `gpu` test runs it on CUDA);
benchmarks/gpu/stage_d_update.py measures it beside disk and zmq.
"""
from __future__ import annotations

import json
import os
import re
import socket
import stat
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Mapping

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from areal_mq.errors import ConfigError, WeightsFetchError, WeightsRefused
from areal_mq.messages import WeightsReady

if TYPE_CHECKING:
    import torch

SLOTS = 2
SEQ, VERSION = 0, 1  # the header's columns
ALIGN = 256  # byte alignment of each tensor in a slot (any dtype's element size divides it)
SET_ID = re.compile(r"^[0-9a-f]{32}$")
MAX_SET_JSON = 16 << 20
DTYPES = ("bfloat16", "float16", "float32", "float64", "int64", "int32", "uint8", "bool")


# ---------------------------------------------------------------- the description of a handle set (JSON)
class TensorSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    name: str = Field(min_length=1, max_length=512)
    dtype: Literal[DTYPES]  # type: ignore[valid-type]
    shape: list[int] = Field(max_length=8)
    offset: int = Field(ge=0)  # bytes from the start of a slot


class CudaBuffer(BaseModel):
    """One slot's CUDA IPC handle: the fields of `storage._share_cuda_()`, bytes as hex."""

    model_config = ConfigDict(extra="forbid", strict=True)
    handle: str = Field(pattern=r"^[0-9a-f]{2,1024}$")
    size: int = Field(gt=0)
    offset: int = Field(ge=0)
    ref_counter_handle: str = Field(pattern=r"^[0-9a-f]{0,1024}$")
    ref_counter_offset: int = Field(ge=0)
    event_handle: str = Field(pattern=r"^[0-9a-f]{0,1024}$")
    event_sync_required: bool


class HandleSet(BaseModel):
    """run_dir/ipc/<set_id>.json, written once by the trainer. Example (CPU):
    {"format": 1, "set_id": "3f…", "run_dir": "/runs/r1", "host": "gpu7:1b2c…", "device": "cpu", "nbytes": 512,
     "tensors": [{"name": "lm_head.weight", "dtype": "bfloat16", "shape": [8, 16], "offset": 0}], "trainer_pid": 41}"""

    model_config = ConfigDict(extra="forbid", strict=True)
    format: Literal[1] = 1
    set_id: str = Field(pattern=SET_ID.pattern)
    run_dir: str
    host: str  # host_id() of the trainer
    device: Literal["cpu", "cuda"]
    device_uuid: str = ""  # cuda: the GPU's UUID (indices differ with CUDA_VISIBLE_DEVICES, UUIDs do not)
    nbytes: int = Field(gt=0)  # of one slot
    tensors: list[TensorSpec] = Field(min_length=1)
    cuda: list[CudaBuffer] = Field(default_factory=list)  # one per slot (cuda only)
    trainer_pid: int = 0

    def check(self) -> None:
        """Raise ValueError when the layout cannot be right (a tensor outside its slot, misaligned, a name twice)."""
        names = set()
        for t in self.tensors:
            end = t.offset + _numel(t.shape) * _itemsize(t.dtype)
            if any(d < 0 for d in t.shape) or end > self.nbytes or t.offset % ALIGN:
                raise ValueError(f"tensor {t.name!r} ({t.dtype}{t.shape} at byte {t.offset}) does not fit a "
                                 f"{self.nbytes}-byte slot aligned to {ALIGN}")
            if t.name in names:
                raise ValueError(f"tensor {t.name!r} is described twice")
            names.add(t.name)
        if (self.device == "cuda") != (len(self.cuda) == SLOTS):
            raise ValueError(f"a {self.device} set has {len(self.cuda)} CUDA handles (want {SLOTS} on cuda, 0 on cpu)")


def _numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _itemsize(dtype: str) -> int:
    return {"bfloat16": 2, "float16": 2, "float32": 4, "float64": 8, "int64": 8, "int32": 4}.get(dtype, 1)


def host_id() -> str:
    """This host's identity: hostname and kernel boot id (a shared run dir on two hosts is not one memory)."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}:{boot}"


def device_uuid(device: "torch.device") -> str:
    import torch

    return str(torch.cuda.get_device_properties(device).uuid) if device.type == "cuda" else ""


def ipc_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / "ipc"


def set_paths(run_dir: str | Path, set_id: str) -> dict[str, Path]:
    """The files of a handle set, built from a validated id only (never a path from a message or a file)."""
    if not SET_ID.match(set_id or ""):
        raise WeightsRefused(f"handle set id {set_id!r} is not 32 hex digits")
    root = ipc_dir(run_dir)
    return {k: root / f"{set_id}.{k}" for k in ("json", "seq", "slots")}


def layout(tensors: Mapping[str, "torch.Tensor"], dtype: str | None) -> tuple[list[TensorSpec], int]:
    """Each tensor's place in a slot (offsets aligned to ALIGN), and the slot's size in bytes."""
    specs, offset = [], 0
    for name, t in tensors.items():
        dt = dtype or str(t.dtype).removeprefix("torch.")
        if dt not in DTYPES:
            raise ConfigError(f"cuda_ipc cannot share tensor {name!r} of dtype {dt}")
        specs.append(TensorSpec(name=name, dtype=dt, shape=list(t.shape), offset=offset))
        offset += -(-t.numel() * _itemsize(dt) // ALIGN) * ALIGN
    return specs, max(offset, ALIGN)


def unique_live(tensors: Mapping[str, "torch.Tensor"]) -> dict[str, "torch.Tensor"]:
    """The tensors without tied duplicates (first name kept, as weights.unique_tensors), detached, not copied."""
    out, seen = {}, set()
    for name, t in tensors.items():
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))
        if key not in seen:
            seen.add(key)
            out[name] = t.detach()
    return out


def slot_views(flat: "torch.Tensor", specs: list[TensorSpec]) -> dict[str, "torch.Tensor"]:
    """name -> view of a slot's flat uint8 buffer (no copy: writes land in the shared memory)."""
    import torch

    out = {}
    for t in specs:
        n = _numel(t.shape) * _itemsize(t.dtype)
        out[t.name] = flat[t.offset:t.offset + n].view(getattr(torch, t.dtype)).view(t.shape)
    return out


def synchronize(device: "torch.device") -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _create(path: Path, data: bytes = b"", size: int = 0) -> None:
    """A new file owned by us, 0600, never following a link; `data`, or `size` zero bytes."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        if data:
            os.write(fd, data)
        else:
            os.ftruncate(fd, size)
    finally:
        os.close(fd)


def _check_file(path: Path, size: int | None = None) -> int:
    """The size of `path` after checking it is a regular file of ours that nobody else may read or write."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        raise WeightsRefused(f"{path.name} is not in this run's ipc directory {path.parent}: unknown handle set "
                             "(from another run, or a trainer that has exited)") from None
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise WeightsRefused(f"{path} must be a regular file of this user with mode 0600 (it is "
                             f"{oct(st.st_mode)}, uid {st.st_uid})")
    if size is not None and st.st_size != size:
        raise WeightsRefused(f"{path} holds {st.st_size} bytes, its handle set says {size}")
    return st.st_size


def _map(path: Path, nbytes: int, dtype: Any) -> "torch.Tensor":
    import torch

    count = nbytes // torch.empty((), dtype=dtype).element_size()
    return torch.from_file(str(path), shared=True, size=count, dtype=dtype)


# ---------------------------------------------------------------- trainer side
class IpcPublisher:
    """Trainer-side cuda_ipc publishing (see the module docstring). `publish` takes the live parameters
    (state-dict names, on the device the buffers go to); call it on the main rank only; `close` removes the files."""

    def __init__(self, run_dir: str | Path, dtype: str | None = "bfloat16"):
        self.run_dir, self.dtype = Path(run_dir), dtype
        self.set: HandleSet | None = None
        self.paths: dict[str, Path] = {}
        self.slots: list[dict[str, Any]] = []
        self.header: Any = None
        self.device: Any = None
        self.newest = -1  # the slot holding the newest version
        self.last_version = -1

    def publish(self, version: int, tensors: Mapping[str, "torch.Tensor"]) -> WeightsReady:
        import torch

        live = unique_live(tensors)
        if self.set is None:
            self._allocate(live)
        assert self.set is not None
        if [t.name for t in self.set.tensors] != list(live) or any(
                list(live[t.name].shape) != t.shape for t in self.set.tensors):
            raise ConfigError("cuda_ipc: the model's parameters changed names or shapes after the shared buffers "
                              "were made; restart the trainer (a new process makes a new handle set)")
        if version <= self.last_version:
            raise ConfigError(f"cuda_ipc: version {version} after {self.last_version}: versions of one handle set "
                              "only go up (a resumed trainer is a new process with a new set)")
        s = (self.newest + 1) % SLOTS
        self.header[s, SEQ] += 1  # odd: being written, a reader of this slot will see the change
        with torch.no_grad():
            for name, view in self.slots[s].items():
                view.copy_(live[name])
        synchronize(self.device)
        self.header[s, VERSION] = version
        self.header[s, SEQ] += 1
        self.newest, self.last_version = s, version
        return WeightsReady(version=version, mode="cuda_ipc", ipc_set=self.set.set_id,
                            meta={"bytes": self.set.nbytes, "slot": s})

    def _allocate(self, live: Mapping[str, "torch.Tensor"]) -> None:
        import torch

        specs, nbytes = layout(live, self.dtype)
        self.device = next(iter(live.values())).device
        set_id = os.urandom(16).hex()
        self.paths = set_paths(self.run_dir, set_id)
        root = ipc_dir(self.run_dir)
        root.mkdir(mode=0o700, parents=True, exist_ok=True)
        _create(self.paths["seq"], size=SLOTS * 2 * 8)
        self.header = _map(self.paths["seq"], SLOTS * 2 * 8, torch.int64).view(SLOTS, 2)
        self.header[:, VERSION] = -1
        cuda: list[CudaBuffer] = []
        if self.device.type == "cuda":
            flats = [torch.empty(nbytes, dtype=torch.uint8, device=self.device) for _ in range(SLOTS)]
            cuda = [share_cuda(f) for f in flats]
        else:
            _create(self.paths["slots"], size=SLOTS * nbytes)
            whole = _map(self.paths["slots"], SLOTS * nbytes, torch.uint8)
            flats = [whole[i * nbytes:(i + 1) * nbytes] for i in range(SLOTS)]
        self.slots = [slot_views(f, specs) for f in flats]
        self.set = HandleSet(set_id=set_id, run_dir=os.path.realpath(self.run_dir), host=host_id(),
                             device=self.device.type, device_uuid=device_uuid(self.device), nbytes=nbytes,
                             tensors=specs, cuda=cuda, trainer_pid=os.getpid())
        tmp = self.paths["json"].with_suffix(".json.tmp")
        _create(tmp, self.set.model_dump_json().encode())
        os.replace(tmp, self.paths["json"])  # a reader sees the whole description or none

    def close(self) -> None:
        """Remove the set's files (what workers mapped stays valid for them until they let go)."""
        for path in self.paths.values():
            path.unlink(missing_ok=True)


def share_cuda(flat: "torch.Tensor") -> CudaBuffer:
    """The CUDA IPC handle of `flat`'s storage as plain fields (what reductions.reduce_tensor sends)."""
    (_device, handle, size, offset, ref_handle, ref_offset, event_handle,
     event_sync) = flat.untyped_storage()._share_cuda_()
    return CudaBuffer(handle=bytes(handle).hex(), size=int(size), offset=int(offset),
                      ref_counter_handle=bytes(ref_handle or b"").hex(), ref_counter_offset=int(ref_offset),
                      event_handle=bytes(event_handle or b"").hex(), event_sync_required=bool(event_sync))


def open_cuda(buf: CudaBuffer, device: "torch.device", nbytes: int) -> "torch.Tensor":
    """A flat uint8 tensor over another process's CUDA buffer, rebuilt from plain fields (classes fixed here)."""
    import torch
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    if buf.size < nbytes:
        raise WeightsRefused(f"a CUDA buffer of {buf.size} bytes cannot hold a {nbytes}-byte slot")
    return rebuild_cuda_tensor(torch.Tensor, (nbytes,), (1,), 0, torch.UntypedStorage, torch.uint8,
                               device.index or 0, bytes.fromhex(buf.handle), buf.size, buf.offset, False,
                               bytes.fromhex(buf.ref_counter_handle), buf.ref_counter_offset,
                               bytes.fromhex(buf.event_handle), buf.event_sync_required)


# ---------------------------------------------------------------- rollout side
class Attached:
    """An opened handle set: its description, the slots' views, the seqlock header, the version loaded from it."""

    def __init__(self, hs: HandleSet, slots: list[dict[str, Any]], header: Any, device: Any):
        self.set, self.slots, self.header, self.device = hs, slots, header, device
        self.loaded = -1

    def whole(self, at_least: int) -> tuple[int, int, int] | None:
        """(slot, version, seq) of the slot holding `at_least`, else of the newest whole version above it."""
        whole = []
        for s in range(SLOTS):
            seq, version = int(self.header[s, SEQ]), int(self.header[s, VERSION])
            if seq % 2 == 0 and version >= at_least:
                whole.append((version != at_least, -version, s, seq))
        if not whole:
            return None
        _, version, s, seq = min(whole)  # the asked version first, else the newest
        return s, -version, seq

    def held(self) -> list[int]:
        return [int(self.header[s, VERSION]) for s in range(SLOTS)]


class TornWeights(RuntimeError):
    """Every in-place copy from the shared buffers was torn until the deadline: the engine holds mixed weights.
    Not an ArealError on purpose: the rollout worker does not retry it, it stops (see IpcReceiver.update)."""


class IpcReceiver:
    """Rollout-side cuda_ipc: `update(engine, ready)` -> the engine's timings (see the module docstring).
    Raises WeightsRefused (not this run's set, not colocated, does not fit the engine, a version going back) or
    WeightsFetchError (the buffers no longer hold the version, or every copy was torn within `timeout_s`)."""

    def __init__(self, run_dir: str | Path, timeout_s: float = 60.0):
        self.run_dir, self.timeout_s = Path(run_dir), timeout_s
        self.attached: Attached | None = None

    def update(self, engine: Any, ready: WeightsReady) -> dict[str, Any]:
        if ready.mode != "cuda_ipc" or not ready.ipc_set:
            raise WeightsRefused(f"a cuda_ipc update needs a cuda_ipc WeightsReady with ipc_set, got mode {ready.mode!r}")
        if self.attached is None or self.attached.set.set_id != ready.ipc_set:
            self.attached = None
            self.attached = self.attach(ready.ipc_set, engine)
        att = self.attached
        if ready.version < att.loaded:
            raise WeightsRefused(f"version {ready.version} of handle set {ready.ipc_set} after version {att.loaded} "
                                 "was loaded from it: versions of one set never go back")
        deadline, torn, t0 = time.monotonic() + self.timeout_s, 0, time.perf_counter()
        while True:
            found = att.whole(ready.version)
            if found is None:
                raise WeightsFetchError(f"the shared buffers hold versions {att.held()}, not version "
                                        f"{ready.version} or later; waiting for the next WeightsReady")
            slot, version, seq = found
            timings = engine.update_weights(version, tensors=att.slots[slot])
            synchronize(att.device)
            if int(att.header[slot, SEQ]) == seq:
                break
            torn += 1  # the trainer reused the slot during the copy: copy the newest whole version again
            if time.monotonic() > deadline:
                # The engine's parameters now hold a torn copy (it copies in place): never decode on them, not even
                # until a retry. Stopping the worker is loud and loses nothing (the broker requeues its jobs, the
                # launcher restarts it, and a new worker copies a whole version before its first job).
                raise TornWeights(f"every copy of version {ready.version}+ from the shared buffers was torn "
                                  f"({torn} tries in {self.timeout_s:g}s): the engine holds mixed weights, so this "
                                  "rollout worker stops rather than generate with them")
        att.loaded = version
        timings.update(ipc_copy_s=time.perf_counter() - t0, torn_retries=torn, loaded_version=version)
        return timings

    def attach(self, set_id: str, engine: Any) -> Attached:
        """Open a handle set of this run for `engine`, after every check (module docstring)."""
        import torch

        paths = set_paths(self.run_dir, set_id)
        hs = read_set(paths["json"], set_id)
        where = os.path.realpath(self.run_dir)
        if os.path.realpath(hs.run_dir) != where:
            raise WeightsRefused(f"handle set {set_id} belongs to the run at {hs.run_dir}, not to this run ({where})")
        if hs.host != host_id():
            raise WeightsRefused(f"cuda_ipc works only colocated: the trainer shares its buffers on host {hs.host}, "
                                 f"this rollout worker runs on {host_id()}; use trainer.publish_mode zmq or disk for "
                                 "workers on other hosts")
        device = torch.device(getattr(engine, "device", "cpu"))
        check_device(hs, device)
        check_fits(hs, engine)
        _check_file(paths["seq"], SLOTS * 2 * 8)
        header = _map(paths["seq"], SLOTS * 2 * 8, torch.int64).view(SLOTS, 2)
        if hs.device == "cuda":
            flats = [open_cuda(b, device, hs.nbytes) for b in hs.cuda]
        else:
            _check_file(paths["slots"], SLOTS * hs.nbytes)
            whole = _map(paths["slots"], SLOTS * hs.nbytes, torch.uint8)
            flats = [whole[i * hs.nbytes:(i + 1) * hs.nbytes] for i in range(SLOTS)]
        return Attached(hs, [slot_views(f, hs.tensors) for f in flats], header, device)


def read_set(path: Path, set_id: str) -> HandleSet:
    """The handle set description at `path`, checked (JSON only, never pickle)."""
    size = _check_file(path)
    if size > MAX_SET_JSON:
        raise WeightsRefused(f"{path} is {size} bytes, more than a handle set's {MAX_SET_JSON}")
    try:
        hs = HandleSet.model_validate(json.loads(path.read_bytes()))
        hs.check()
    except (ValueError, ValidationError) as exc:
        raise WeightsRefused(f"handle set {path} is malformed: {str(exc)[:500]}") from None
    if hs.set_id != set_id:
        raise WeightsRefused(f"{path} describes handle set {hs.set_id}, not {set_id}")
    return hs


def check_device(hs: HandleSet, device: "torch.device") -> None:
    """The engine must run on the very device holding the buffers (same GPU by UUID; cpu with cpu)."""
    if device.type != hs.device or (hs.device == "cuda" and device_uuid(device) != hs.device_uuid):
        theirs = f"{hs.device} {hs.device_uuid}".strip()
        ours = f"{device} {device_uuid(device) if device.type == 'cuda' else ''}".strip()
        raise WeightsRefused(f"cuda_ipc works only colocated: the trainer's buffers are on {theirs}, this rollout "
                             f"worker's engine on {ours}; put both on one device or use trainer.publish_mode zmq")


def check_fits(hs: HandleSet, engine: Any) -> None:
    """Every shared tensor is one of the engine's parameters, of its shape, of a dtype it can take (a float into a
    float: cast on the device), and every parameter is shared. Engines that do not expose `model` check themselves."""
    model = getattr(engine, "model", None)
    if model is None or not hasattr(model, "named_parameters"):
        return
    params = dict(model.named_parameters(remove_duplicate=False))
    groups: dict[int, list[str]] = {}
    for name, p in params.items():
        groups.setdefault(id(p), []).append(name)
    shared = {t.name: t for t in hs.tensors}
    wrong = [f"{t.name}: not a parameter of the engine's model" for t in hs.tensors if t.name not in params]
    for t in hs.tensors:
        p = params.get(t.name)
        if p is None:
            continue
        if list(p.shape) != t.shape:
            wrong.append(f"{t.name}: shared {t.shape}, engine {list(p.shape)}")
        elif str(p.dtype).removeprefix("torch.") != t.dtype and not (p.dtype.is_floating_point and "float" in t.dtype):
            wrong.append(f"{t.name}: shared {t.dtype}, engine {str(p.dtype).removeprefix('torch.')}")
    wrong += [f"{g[0]}: not shared" for g in groups.values() if not any(n in shared for n in g)]
    if wrong:
        raise WeightsRefused(f"handle set {hs.set_id} does not fit the engine's parameters ({len(wrong)} problems): "
                             f"{'; '.join(wrong[:5])}; the trainer and the engine must load the same model")


def check_ready_ipc(ready: WeightsReady, publish_mode: str) -> str | None:
    """None when a cuda_ipc WeightsReady may be announced in this run (weights.check_ready), else why not."""
    if publish_mode != "cuda_ipc":
        return f"a cuda_ipc WeightsReady comes only from a trainer with publish_mode cuda_ipc (this run: {publish_mode})"
    if not SET_ID.match(ready.ipc_set) or ready.path or ready.endpoint:
        return "a cuda_ipc WeightsReady names a handle set (ipc_set, 32 hex digits) and no path or endpoint"
    return None


def check_config(cfg: Any) -> None:
    """RunConfig's rule for cuda_ipc: the trainer and the rollout workers on one device (the same spec: cuda:0 and
    cuda:0, auto and auto; cpu and cpu runs the same protocol on shared memory), and no deltas (nothing travels)."""
    from areal_mq.devices import role_device

    if cfg.trainer.publish_mode != "cuda_ipc":
        return
    norm = {"cuda": "cuda:0"}
    trainer, rollout = role_device(cfg, "trainer"), role_device(cfg, "rollout")
    if norm.get(trainer, trainer) != norm.get(rollout, rollout) or trainer == "meta":
        raise ConfigError(f"trainer.publish_mode cuda_ipc shares the trainer's buffers with colocated rollout "
                          f"workers on one device, but the trainer runs on {trainer!r} and the rollout workers on "
                          f"{rollout!r}; set one device for both (model.device) or use publish_mode zmq or disk")
    if cfg.trainer.weight_deltas == "on":
        raise ConfigError("trainer.weight_deltas on has no effect with publish_mode cuda_ipc (a version is one "
                          "device copy, nothing travels); leave weight_deltas auto or off")
