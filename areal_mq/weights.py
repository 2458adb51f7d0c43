"""Publishing policy weights from the trainer to rollout workers, and loading them back.

What:
- disk: `publish_disk(weights_dir, version, tensors, keep)` writes weights_dir/v{N}/model.safetensors
  (+ config.json when given, so the directory also loads with from_pretrained) under a temporary
  name and renames it into place — a reader never sees half a version — then prunes all but the
  last `keep` versions. Returns WeightsReady(mode="disk", path=...).
- zmq: `WeightServer` binds a ROUTER socket (127.0.0.1 by default) in a background thread and answers
  WeightsFetch(version, index) with WeightsChunk; tensors travel as their raw little-endian bytes
  (bf16 included), several per chunk up to `chunk_bytes` (a tensor is never split). Frames are built
  only by areal_mq.protocol. `fetch_weights(ready, timeout_s)` pulls every chunk (two in flight) and
  raises WeightsFetchError — never hangs — when the server does not answer within the deadline
  (e.g. the trainer died), refuses the version, or sends something malformed.
- `load_published(ready, timeout_s)` -> {name: tensor} for any mode ("base": {} — nothing to load).
- `resolve(ready, run_dir, cfg, timeout_s, keys)` -> what an engine's update_weights takes: {"path": dir}
  for disk (each engine reads it its own way), {"tensors": {...}} for zmq; checked with check_ready first.
- `WeightPublisher(cfg, run_dir, keys)` is the trainer-side facade choosing the mode from TrainerConfig.
- `check_ready(ready, run_dir, cfg)`: a WeightsReady may only name a version directory under the run's
  weights directory, or the trainer's configured weight-server address; the bus refuses any other
  (and rollout workers check again before loading).
Security: with CURVE keys the weight server uses the trainer's key pair, so a fetcher that connects
with `keys.client(sock, "trainer")` talks to the real trainer or to nobody; only roles allowed
"weights:fetch" (security.PERMISSIONS) are served.
Tensor names are the model's state-dict names with tied duplicates dropped (as save_pretrained does).

How to run: tests/unit/test_weights.py (round trips, pruning, a server killed mid-run).
"""
from __future__ import annotations

import json
import os
import re
import shutil
import threading
import time
from collections import OrderedDict
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

import numpy as np

from areal_mq.errors import ProtocolError, WeightsFetchError, WeightsRefused
from areal_mq.messages import Error, WeightsChunk, WeightsFetch, WeightsReady
from areal_mq.security import Keyring, peer_role, refusal, start_zap

if TYPE_CHECKING:
    import torch

    from areal_mq.algorithms.config import TrainerConfig

DTYPES = ("bfloat16", "float16", "float32", "float64", "int64", "int32", "uint8", "bool")
_VERSION_DIR = re.compile(r"^v(\d+)$")


# ---------------------------------------------------------------- tensor <-> raw bytes
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


# ---------------------------------------------------------------- disk
def publish_disk(weights_dir: str | Path, version: int, tensors: Mapping[str, "torch.Tensor"], keep: int = 2,
                 hf_config_json: str | None = None) -> WeightsReady:
    """Write version `version` atomically under weights_dir/v{version}; prune to the last `keep`."""
    from safetensors.torch import save_file

    root = Path(weights_dir)
    root.mkdir(parents=True, exist_ok=True)
    final, tmp = root / f"v{version}", root / f".v{version}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        save_file(dict(tensors), str(tmp / "model.safetensors"), metadata={"format": "pt", "version": str(version)})
        if hf_config_json is not None:
            (tmp / "config.json").write_text(hf_config_json)
        if final.exists():  # republishing a version (e.g. after a resume): swap it out
            old = root / f".v{version}.old-{os.getpid()}"
            final.rename(old)
            shutil.rmtree(old, ignore_errors=True)
        tmp.rename(final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    prune_disk(root, keep)
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    return WeightsReady(version=version, mode="disk", path=str(final.resolve()), meta={"bytes": int(nbytes)})


def disk_versions(weights_dir: str | Path) -> list[int]:
    root = Path(weights_dir)
    if not root.is_dir():
        return []
    return sorted(int(m.group(1)) for p in root.iterdir() if (m := _VERSION_DIR.match(p.name)))


def prune_disk(weights_dir: str | Path, keep: int) -> None:
    for v in disk_versions(weights_dir)[:-keep]:
        shutil.rmtree(Path(weights_dir) / f"v{v}", ignore_errors=True)


def read_disk(path: str | Path) -> dict[str, "torch.Tensor"]:
    from safetensors.torch import load_file

    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise WeightsFetchError(f"no *.safetensors in {path}; the version may have been pruned — "
                                "wait for the next WeightsReady or raise trainer.keep_weight_versions")
    out: dict[str, Any] = {}
    for f in files:
        out.update(load_file(str(f)))
    return out


# ---------------------------------------------------------------- zmq
def make_chunks(version: int, tensors: Mapping[str, "torch.Tensor"], chunk_bytes: int) -> list[WeightsChunk]:
    """Group tensors (in order) into chunks of about `chunk_bytes`; a larger tensor travels alone."""
    groups: list[list[tuple[str, Any]]] = [[]]
    size = 0
    for name, t in tensors.items():
        n = t.numel() * t.element_size()
        if groups[-1] and size + n > chunk_bytes:
            groups.append([])
            size = 0
        groups[-1].append((name, t))
        size += n
    chunks = []
    for i, group in enumerate(groups):
        chunks.append(WeightsChunk(
            version=version, index=i, total=len(groups), names=[n for n, _ in group],
            dtypes=[str(t.dtype).removeprefix("torch.") for _, t in group],
            shapes=[list(t.shape) for _, t in group], tensors=[tensor_bytes(t) for _, t in group]))
    return chunks


class WeightServer:
    """Serves published versions over a ROUTER socket from a background thread (the socket lives and
    dies in that thread). `publish` pre-encodes a version's chunks; the last `keep` versions stay
    fetchable so a worker halfway through a fetch is not cut off by the next publish."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, keep: int = 2, chunk_bytes: int = 64 << 20,
                 keys: Keyring | None = None, log: Any = None):
        self.host, self.port, self.keep, self.chunk_bytes = host, port, keep, chunk_bytes
        self.keys, self.log = keys or Keyring.insecure("trainer"), log
        self.refused = 0
        self.endpoint = ""
        self._versions: OrderedDict[int, list[list[Any]]] = OrderedDict()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._bound = threading.Event()
        self._error: BaseException | None = None
        self.served_chunks = 0
        self._thread = threading.Thread(target=self._serve, name="weight-server", daemon=True)
        self._thread.start()
        if not self._bound.wait(10.0) or self._error is not None:
            self._stop.set()
            raise WeightsFetchError(f"weight server could not bind tcp://{host}:{port}: {self._error}")

    def publish(self, version: int, tensors: Mapping[str, "torch.Tensor"]) -> WeightsReady:
        """Make `version` fetchable (the tensors must be a snapshot: they are served as they are)."""
        from areal_mq.protocol import encode

        chunks = make_chunks(version, tensors, self.chunk_bytes)
        frames = [encode(c) for c in chunks]
        with self._lock:
            self._versions[version] = frames
            self._versions.move_to_end(version)
            while len(self._versions) > self.keep:
                self._versions.popitem(last=False)
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        return WeightsReady(version=version, mode="zmq", endpoint=self.endpoint, num_chunks=len(chunks),
                            meta={"bytes": int(nbytes)})

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5.0)

    def _serve(self) -> None:
        import zmq

        ctx = zmq.Context()
        zap = start_zap(ctx, self.keys, self.log)  # before bind: no connection is ever unchecked
        sock = self.keys.server(ctx.socket(zmq.ROUTER))
        sock.linger = 0
        try:
            if self.port:
                sock.bind(f"tcp://{self.host}:{self.port}")
            else:
                self.port = sock.bind_to_random_port(f"tcp://{self.host}")
            self.endpoint = f"tcp://{self.host}:{self.port}"
        except zmq.ZMQError as exc:
            self._error = exc
            sock.close(0)
            if zap:
                zap.close()
            ctx.term()
            self._bound.set()
            return
        self._bound.set()
        try:
            while not self._stop.is_set():
                if sock.poll(100):
                    self._handle(sock, sock.recv_multipart(copy=False))
        finally:
            sock.close(0)
            if zap:
                zap.close()
            ctx.term()

    def _handle(self, sock: Any, frames: list[Any]) -> None:
        from areal_mq.protocol import decode, encode, error_reply, split_router

        try:
            ident, rest = split_router(frames)
        except ProtocolError:
            return  # no identity to answer
        try:
            env = decode(rest)
        except ProtocolError as exc:
            sock.send_multipart([ident, *error_reply(exc)])
            return
        msg = env.msg
        reply = None
        why = refusal(peer_role(frames[0], self.keys.secure), "weights:fetch")
        if why:
            self.refused += 1
            reply = Error(code="forbidden", message=why, ref_id=env.id)
        elif not isinstance(msg, WeightsFetch):
            reply = Error(code="bad_request", message=f"the weight server takes weights_fetch, got {msg.kind.value}",
                          ref_id=env.id)
        else:
            with self._lock:
                chunks = self._versions.get(msg.version)
                have = list(self._versions)
            if chunks is None:
                reply = Error(code="bad_request", ref_id=env.id, message=(
                    f"version {msg.version} is not served here (available: {have}); "
                    "fetch the version of the latest WeightsReady"))
            elif msg.index >= len(chunks):
                reply = Error(code="bad_request", ref_id=env.id,
                              message=f"version {msg.version} has {len(chunks)} chunks; index {msg.index} is out of range")
        if reply is not None:
            sock.send_multipart([ident, *encode(reply, reply_to=env.id)])
            return
        sock.send_multipart([ident, *chunks[msg.index]], copy=False)
        self.served_chunks += 1


def fetch_weights(ready: WeightsReady, timeout_s: float = 60.0, in_flight: int = 2,
                  keys: Keyring | None = None) -> dict[str, "torch.Tensor"]:
    """All tensors of `ready` (mode "zmq") from its weight server, within `timeout_s` overall.

    Raises WeightsFetchError naming the endpoint, the version and how far it got when the server is
    silent past the deadline (dead or unreachable), refuses the version, or answers garbage."""
    import zmq

    from areal_mq.protocol import decode, encode

    if ready.mode != "zmq" or not ready.endpoint:
        raise WeightsFetchError(f"fetch_weights needs a zmq WeightsReady with an endpoint, got mode={ready.mode!r}")
    deadline = time.monotonic() + timeout_s
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    if keys is not None:
        keys.client(sock, server="trainer")
    sock.connect(ready.endpoint)
    total = ready.num_chunks or None  # unknown: learn it from the first chunk
    out: dict[str, Any] = {}
    received: set[int] = set()
    next_index = 0
    try:
        while total is None or len(received) < total:
            limit = 1 if total is None else total
            while next_index < limit and next_index - len(received) < in_flight:
                sock.send_multipart(encode(WeightsFetch(version=ready.version, index=next_index)))
                next_index += 1
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not sock.poll(max(1, int(remaining * 1000))):
                raise WeightsFetchError(
                    f"weight server {ready.endpoint} did not deliver version {ready.version} within {timeout_s:g}s "
                    f"({len(received)}/{total or '?'} chunks received); the trainer may have died or restarted — "
                    "wait for the next WeightsReady")
            chunk = _check_reply(decode(sock.recv_multipart(copy=False)).msg, ready)
            if chunk.index in received:
                continue
            total = chunk.total
            received.add(chunk.index)
            for name, dtype, shape, buf in zip(chunk.names, chunk.dtypes, chunk.shapes, chunk.tensors):
                out[name] = bytes_tensor(buf, dtype, shape)
    except ProtocolError as exc:
        raise WeightsFetchError(f"malformed reply from weight server {ready.endpoint}: {exc}") from None
    finally:
        sock.close(0)
        ctx.term()
    return out


def _check_reply(msg: Any, ready: WeightsReady) -> WeightsChunk:
    if isinstance(msg, Error):
        raise WeightsFetchError(f"weight server {ready.endpoint} refused version {ready.version}: "
                                f"{msg.code}: {msg.message}")
    if not isinstance(msg, WeightsChunk):
        raise WeightsFetchError(f"weight server {ready.endpoint} answered {msg.kind.value}, expected weights_chunk")
    if msg.version != ready.version or not 0 <= msg.index < msg.total:
        raise WeightsFetchError(f"weight server {ready.endpoint} sent chunk {msg.index}/{msg.total} of version "
                                f"{msg.version} while version {ready.version} was asked")
    if ready.num_chunks and msg.total != ready.num_chunks:
        raise WeightsFetchError(f"version {ready.version} announced {ready.num_chunks} chunks, server says {msg.total}")
    return msg


def load_published(ready: WeightsReady, timeout_s: float = 60.0,
                   keys: Keyring | None = None) -> dict[str, "torch.Tensor"]:
    """Tensors of a published version, any mode ("base": {} — the initial model, nothing to load)."""
    if ready.mode == "base":
        return {}
    if ready.mode == "disk":
        return read_disk(ready.path)
    return fetch_weights(ready, timeout_s, keys=keys)


def resolve(ready: WeightsReady, run_dir: str | Path, cfg: "TrainerConfig", timeout_s: float = 60.0,
            keys: Keyring | None = None) -> dict[str, Any]:
    """The keyword argument of Engine.update_weights for `ready`: {"path": ...} or {"tensors": ...}.
    Raises WeightsRefused when it points outside this run, WeightsFetchError when the zmq fetch fails."""
    why = check_ready(ready, run_dir, cfg)
    if why:
        raise WeightsRefused(why)
    if ready.mode == "disk":
        return {"path": ready.path}
    if ready.mode == "sim":
        return {}  # a simulated trainer's version: nothing to fetch (only a simulated engine accepts it)
    return {"tensors": load_published(ready, timeout_s, keys)}


_ENDPOINT = re.compile(r"^tcp://(.+):(\d{1,5})$")


def check_ready(ready: WeightsReady, run_dir: str | Path, cfg: "TrainerConfig") -> str | None:
    """None when `ready` points where this run's trainer publishes, else what is wrong with it."""
    if ready.mode == "base":
        return None if not ready.path and not ready.endpoint else "a 'base' WeightsReady names no path or endpoint"
    if ready.mode == "sim":
        if not cfg.sim.enabled:
            return "a 'sim' WeightsReady comes only from a simulated trainer (trainer.sim.enabled) and this run has none"
        return None if not ready.path and not ready.endpoint else "a 'sim' WeightsReady names no path or endpoint"
    if ready.mode == "disk":
        root = os.path.realpath(Path(run_dir) / "weights")
        path = os.path.realpath(ready.path) if ready.path else ""
        if not path or os.path.dirname(path) != root or not _VERSION_DIR.match(os.path.basename(path)):
            return f"weights path {ready.path!r} is not a version directory under the run's weights dir {root}"
        return None
    m = _ENDPOINT.match(ready.endpoint)
    port_ok = m and (cfg.weight_server_port == 0 or int(m.group(2)) == cfg.weight_server_port)
    if not m or m.group(1) != cfg.weight_server_host or not port_ok:
        want = f"tcp://{cfg.weight_server_host}:{cfg.weight_server_port or 'PORT'}"
        return f"weights endpoint {ready.endpoint!r} is not the trainer's weight server ({want})"
    return None


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


class WeightPublisher:
    """Trainer-side publishing in the mode TrainerConfig chooses (disk dirs under run_dir/weights or
    a WeightServer). Call `publish` on the main rank only."""

    def __init__(self, cfg: "TrainerConfig", run_dir: str | Path, keys: Keyring | None = None, log: Any = None):
        self.cfg = cfg
        self.weights_dir = Path(run_dir) / "weights"
        self.server = None
        if cfg.publish_mode == "zmq":
            self.server = WeightServer(cfg.weight_server_host, cfg.weight_server_port, cfg.keep_weight_versions,
                                       int(cfg.weight_chunk_mb * (1 << 20)), keys=keys, log=log)

    def publish(self, version: int, tensors: Mapping[str, "torch.Tensor"], hf_config_json: str | None = None,
                snapshot: bool = False) -> WeightsReady:
        """Publish `tensors` as `version`. They are copied first (unique_tensors in cfg.publish_dtype) unless
        `snapshot` says they already are such a copy (Trainer.publish_tensors)."""
        if not snapshot:
            tensors = unique_tensors(tensors, self.cfg.publish_dtype)
        if self.server is not None:
            return self.server.publish(version, tensors)
        return publish_disk(self.weights_dir, version, tensors, self.cfg.keep_weight_versions, hf_config_json)

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
