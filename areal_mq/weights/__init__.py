"""Publishing policy weights from the trainer to rollout workers, and loading them back.

What:
- disk: the version directories under run_dir/weights live in areal_mq/weights/disk.py (publish_disk,
  DiskDelta, prune_disk, disk_versions, read_disk); their names are re-exported here.
- zmq: `WeightServer` binds a ROUTER socket (127.0.0.1 by default) in a background thread and answers
  WeightsFetch(version, index) with WeightsChunk; tensors travel as their raw little-endian bytes
  (bf16 included), several per chunk up to `chunk_bytes` (a tensor is never split). Frames are built
  only by areal_mq.protocol. `fetch_weights(ready, timeout_s)` pulls every chunk (two in flight) and
  raises WeightsFetchError — never hangs — when the server does not answer within the deadline
  (e.g. the trainer died), refuses the version, or sends something malformed.
- cuda_ipc (colocated: trainer and engine on one device): areal_mq/weights/ipc.py — shared buffers, one device
  copy per version; WeightPublisher hands it the live parameters, check_ready checks the announcement.
- `load_published(ready, timeout_s)` -> {name: tensor} for any mode ("base": {} — nothing to load).
- `resolve(ready, run_dir, cfg, timeout_s, keys)` -> what an engine's update_weights takes: {"path": dir}
  for disk (each engine reads it its own way), {"tensors": {...}} for zmq; checked with check_ready first.
- `WeightPublisher(cfg, run_dir, keys)` is the trainer-side facade choosing the mode from TrainerConfig.
- `check_ready(ready, run_dir, cfg)`: a WeightsReady may only name a version directory under the run's
  weights directory, or the trainer's configured weight-server address; the bus refuses any other
  (and rollout workers check again before loading).
Deltas (trainer.weight_deltas; codec in areal_mq/weights/delta.py, the receiver's catch-up in
areal_mq/weights/catchup.py): the server also serves each version as a delta from the previous one
(WeightsFetch.base), keeping the last `full_every` deltas; on disk a version directory holds model.delta
(a delta from the previous version) and, every `full_every` versions, a full model.safetensors too (see
weights/disk.py). Every full chunk and every delta carries the blake2b checksum of each resulting tensor;
WeightsReady.links lists the pieces.
Security: with CURVE keys the weight server uses the trainer's key pair, so a fetcher that connects
with `keys.client(sock, "trainer")` talks to the real trainer or to nobody; only roles allowed
"weights:fetch" (security.PERMISSIONS) are served.
Tensor names are the model's state-dict names with tied duplicates dropped (as save_pretrained does).

How to run: tests/unit/test_weights.py (round trips, pruning, a server killed mid-run).
"""
from __future__ import annotations

import os
import re
import threading
import time
from collections import OrderedDict
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

import numpy as np

from areal_mq.errors import ProtocolError, WeightsFetchError, WeightsRefused
from areal_mq.messages import Error, WeightsChunk, WeightsFetch, WeightsLink, WeightsReady
from areal_mq.weights.delta import DeltaError, TensorDelta, checksum, encode_version
from areal_mq.weights.ipc import IpcPublisher, check_ready_ipc
from areal_mq.security import Keyring, peer_role, refusal, start_zap
from areal_mq.weights.disk import (  # noqa: F401  (re-exported: the disk half's public names)
    DELTA_FILE, FULL_FILE, VERSION_DIR, DiskDelta, disk_links, disk_versions, prune_disk, publish_disk, read_disk)

if TYPE_CHECKING:
    import torch

    from areal_mq.algorithms.config import TrainerConfig

DTYPES = ("bfloat16", "float16", "float32", "float64", "int64", "int32", "uint8", "bool")


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


# ---------------------------------------------------------------- zmq
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


class _Piece:
    """Pre-encoded frames of one fetchable piece (a full version, or a delta from `base`)."""

    def __init__(self, chunks: list[WeightsChunk], nbytes: int):
        from areal_mq.protocol import encode

        self.frames = [encode(c) for c in chunks]
        self.nbytes = nbytes


class WeightServer:
    """Serves published versions over a ROUTER socket from a background thread (the socket lives and
    dies in that thread). `publish` pre-encodes a version's chunks; the last `keep` versions stay
    fetchable in full so a worker halfway through a fetch is not cut off by the next publish. With
    `deltas`, each version is also served as a delta from the previous one; the last `chain` deltas stay."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, keep: int = 2, chunk_bytes: int = 64 << 20,
                 keys: Keyring | None = None, log: Any = None, deltas: bool = False, chain: int = 20):
        self.host, self.port, self.keep, self.chunk_bytes = host, port, keep, chunk_bytes
        self.deltas, self.chain = deltas, chain
        self.keys, self.log = keys or Keyring.insecure("trainer"), log
        self.refused = 0
        self.endpoint = ""
        self._full: OrderedDict[int, _Piece] = OrderedDict()
        self._delta: OrderedDict[int, tuple[int, _Piece]] = OrderedDict()  # version -> (base, piece)
        self._last: tuple[int, Mapping[str, Any]] | None = None  # the previous publish, the next delta's base
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._bound = threading.Event()
        self._error: BaseException | None = None
        self.served_chunks = 0
        self.failed_requests = 0  # requests whose handling raised (logged; the server keeps serving)
        self._thread = threading.Thread(target=self._serve, name="weight-server", daemon=True)
        self._thread.start()
        if not self._bound.wait(10.0) or self._error is not None:
            self._stop.set()
            raise WeightsFetchError(f"weight server could not bind tcp://{host}:{port}: {self._error}")

    def publish(self, version: int, tensors: Mapping[str, "torch.Tensor"],
                digests: Mapping[str, str] | None = None,
                diff: Mapping[str, "torch.Tensor"] | None = None) -> WeightsReady:
        """Make `version` fetchable (the tensors must be a snapshot: they are served as they are). `digests`: their
        checksums when the caller has them already (with deltas they are computed here otherwise). `diff`: the same
        snapshot where it was taken (a trainer rank's GPU): the delta is then computed there, against the previous
        publish's `diff`, which is what this server keeps as the next base (one snapshot of device memory) instead
        of the host copy."""
        if digests is None and self.deltas:
            digests = {k: checksum(t) for k, t in tensors.items()}
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        chunks = make_chunks(version, tensors, self.chunk_bytes, digests)
        full = _Piece(chunks, nbytes)
        delta = None
        base = tensors if diff is None else diff
        if self.deltas and self._last is not None and self._last[0] == version - 1 and same_layout(
                self._last[1], base) and all(self._last[1][k].device == t.device for k, t in base.items()):
            deltas = encode_version(self._last[1], base, digests)
            dchunks = make_delta_chunks(version, version - 1, deltas, self.chunk_bytes)
            delta = _Piece(dchunks, sum(d.nbytes for d in deltas))
        self._last = (version, base) if self.deltas else None
        with self._lock:
            self._full[version] = full
            self._full.move_to_end(version)
            while len(self._full) > self.keep:
                self._full.popitem(last=False)
            if delta is None or any(v >= version for v in self._delta):
                self._delta.clear()  # the chain is broken (first version, a resume, a new layout)
            if delta is not None:
                self._delta[version] = (version - 1, delta)
            while len(self._delta) > self.chain:
                self._delta.popitem(last=False)
            links = [WeightsLink(version=v, chunks=len(p.frames), bytes=p.nbytes) for v, p in self._full.items()]
            links += [WeightsLink(version=v, base=b, chunks=len(p.frames), bytes=p.nbytes)
                      for v, (b, p) in self._delta.items()]
        if not self.deltas:
            links = []
        return WeightsReady(version=version, mode="zmq", endpoint=self.endpoint, num_chunks=len(chunks),
                            base=version - 1 if delta else -1, delta_chunks=len(delta.frames) if delta else 0,
                            links=links, meta={"bytes": int(nbytes)})

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5.0)

    def _serve(self) -> None:
        import zmq

        ctx = zmq.Context()
        zap = start_zap(ctx, self.keys, self.log)  # before bind: no connection is ever unchecked
        sock = self.keys.server(ctx.socket(zmq.ROUTER), "weight_server")
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
                    frames = sock.recv_multipart(copy=False)
                    try:
                        self._handle(sock, frames)
                    except Exception as exc:  # noqa: BLE001 - one bad request must never end the server's thread
                        self.failed_requests += 1
                        if self.log is not None:
                            self.log.error("weights.server_request_failed", error=f"{type(exc).__name__}: {exc}"[:300],
                                           failed=self.failed_requests)
        finally:
            sock.close(0)
            if zap:
                zap.close()
            ctx.term()

    def _lookup(self, msg: WeightsFetch) -> tuple[list[list[Any]] | None, str]:
        """The frames asked for, or None and why not."""
        with self._lock:
            if msg.base < 0:
                piece, have = self._full.get(msg.version), f": {list(self._full)}"
            else:
                base, piece = self._delta.get(msg.version, (None, None))
                piece = piece if base == msg.base else None
                have = f" deltas: {[f'{b}->{v}' for v, (b, _) in self._delta.items()]}"
        what = f"version {msg.version}" if msg.base < 0 else f"the delta {msg.base}->{msg.version}"
        if piece is None:
            return None, (f"{what} is not served here (available{have}); "
                          "fetch the version of the latest WeightsReady")
        if msg.index >= len(piece.frames):
            return None, f"{what} has {len(piece.frames)} chunks; index {msg.index} is out of range"
        return piece.frames, ""

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
        reply, chunks = None, None
        why = refusal(peer_role(frames[0], self.keys.secure), "weights:fetch")
        if why:
            self.refused += 1
            reply = Error(code="forbidden", message=why, ref_id=env.id)
        elif not isinstance(msg, WeightsFetch):
            reply = Error(code="bad_request", message=f"the weight server takes weights_fetch, got {msg.kind.value}",
                          ref_id=env.id)
        else:
            chunks, why = self._lookup(msg)
            if chunks is None:
                reply = Error(code="bad_request", ref_id=env.id, message=why)
        if reply is not None:
            sock.send_multipart([ident, *encode(reply, reply_to=env.id)])
            return
        sock.send_multipart([ident, *chunks[msg.index]], copy=False)
        self.served_chunks += 1


def same_layout(a: Mapping[str, "torch.Tensor"], b: Mapping[str, "torch.Tensor"]) -> bool:
    """Same names in the same order, dtypes and shapes: a delta from `a` to `b` is possible."""
    return list(a) == list(b) and all(a[k].dtype == b[k].dtype and a[k].shape == b[k].shape for k in a)


def fetch_chunks(endpoint: str, version: int, base: int, total: int, timeout_s: float = 60.0, in_flight: int = 2,
                 keys: Keyring | None = None) -> list[WeightsChunk]:
    """Every chunk of a piece (the full `version` when base is -1, else its delta from `base`), in order,
    within `timeout_s` overall. Raises WeightsFetchError naming the endpoint, the version and how far it got
    when the server is silent past the deadline (dead or unreachable), refuses, or answers garbage; a piece
    the server does not hold (pruned, never made) is DeltaError("missing"), a WeightsFetchError too."""
    import zmq

    from areal_mq.protocol import decode, encode

    what = f"version {version}" if base < 0 else f"the delta {base}->{version}"
    deadline = time.monotonic() + timeout_s
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    if keys is not None:
        keys.client(sock, server="trainer")
    sock.connect(endpoint)
    want = total or None  # unknown: learn it from the first chunk
    got: dict[int, WeightsChunk] = {}
    next_index = 0
    try:
        while want is None or len(got) < want:
            limit = 1 if want is None else want
            while next_index < limit and next_index - len(got) < in_flight:
                sock.send_multipart(encode(WeightsFetch(version=version, index=next_index, base=base)))
                next_index += 1
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not sock.poll(max(1, int(remaining * 1000))):
                raise WeightsFetchError(
                    f"weight server {endpoint} did not deliver {what} within {timeout_s:g}s "
                    f"({len(got)}/{want or '?'} chunks received); the trainer may have died or restarted — "
                    "wait for the next WeightsReady")
            chunk = _check_reply(decode(sock.recv_multipart(copy=False)).msg, endpoint, version, base, total, what)
            want = chunk.total
            got[chunk.index] = chunk
    except ProtocolError as exc:
        raise WeightsFetchError(f"malformed reply from weight server {endpoint}: {exc}") from None
    finally:
        sock.close(0)
        ctx.term()
    return [got[i] for i in range(len(got))]


def fetch_weights(ready: WeightsReady, timeout_s: float = 60.0, in_flight: int = 2,
                  keys: Keyring | None = None) -> dict[str, "torch.Tensor"]:
    """All tensors of `ready` (mode "zmq") from its weight server, within `timeout_s` overall; checked
    against the chunks' checksums when the server sends them (DeltaError("checksum") otherwise)."""
    from areal_mq.weights.delta import verify

    if ready.mode != "zmq" or not ready.endpoint:
        raise WeightsFetchError(f"fetch_weights needs a zmq WeightsReady with an endpoint, got mode={ready.mode!r}")
    out: dict[str, Any] = {}
    digests: dict[str, str] = {}
    for chunk in fetch_chunks(ready.endpoint, ready.version, -1, ready.num_chunks, timeout_s, in_flight, keys):
        for name, dtype, shape, buf in zip(chunk.names, chunk.dtypes, chunk.shapes, chunk.tensors):
            out[name] = bytes_tensor(buf, dtype, shape)
        digests.update(zip(chunk.names, chunk.checksums))
    verify(out, digests)
    return out


def fetch_delta(endpoint: str, version: int, base: int, total: int, timeout_s: float = 60.0,
                keys: Keyring | None = None) -> list[TensorDelta]:
    """The deltas base -> version from a weight server (see fetch_chunks)."""
    return [d for c in fetch_chunks(endpoint, version, base, total, timeout_s, keys=keys) for d in chunk_deltas(c)]


def _check_reply(msg: Any, endpoint: str, version: int, base: int, total: int, what: str) -> WeightsChunk:
    if isinstance(msg, Error):
        text = f"weight server {endpoint} refused {what}: {msg.code}: {msg.message}"
        raise DeltaError("missing", text) if msg.code == "bad_request" else WeightsFetchError(text)
    if not isinstance(msg, WeightsChunk):
        raise WeightsFetchError(f"weight server {endpoint} answered {msg.kind.value}, expected weights_chunk")
    if msg.version != version or msg.base != base or not 0 <= msg.index < msg.total:
        raise WeightsFetchError(f"weight server {endpoint} sent chunk {msg.index}/{msg.total} of version "
                                f"{msg.version} (base {msg.base}) while {what} was asked")
    if total and msg.total != total:
        raise WeightsFetchError(f"{what} announced {total} chunks, server says {msg.total}")
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
    if ready.mode in ("sim", "cuda_ipc"):  # sim: nothing exists (only a simulated engine accepts it); cuda_ipc:
        return {}  # nothing to fetch, the worker copies the shared buffers (weights.ipc.IpcReceiver)
    return {"tensors": load_published(ready, timeout_s, keys)}


_ENDPOINT = re.compile(r"^tcp://(.+):(\d{1,5})$")


def rank_host(cfg: "TrainerConfig", rank: int) -> str:
    """The address trainer rank `rank`'s weight server binds: trainer.weight_server_hosts[rank] when the trainer
    spans hosts, else trainer.weight_server_host (a rank past the list gets no address anyone accepts)."""
    if not cfg.weight_server_hosts:
        return cfg.weight_server_host
    return cfg.weight_server_hosts[rank] if 0 <= rank < len(cfg.weight_server_hosts) else "(no such rank)"


def check_ready(ready: WeightsReady, run_dir: str | Path, cfg: "TrainerConfig") -> str | None:
    """None when `ready` points where this run's trainer publishes, else what is wrong with it."""
    if ready.mode == "base":
        return None if not ready.path and not ready.endpoint else "a 'base' WeightsReady names no path or endpoint"
    if ready.mode == "cuda_ipc":
        return check_ready_ipc(ready, cfg.publish_mode)
    if ready.mode == "sim":
        if not cfg.sim.enabled:
            return "a 'sim' WeightsReady comes only from a simulated trainer (trainer.sim.enabled) and this run has none"
        return None if not ready.path and not ready.endpoint else "a 'sim' WeightsReady names no path or endpoint"
    if ready.mode == "disk":
        root = os.path.realpath(Path(run_dir) / "weights")
        path = os.path.realpath(ready.path) if ready.path else ""
        if not path or os.path.dirname(path) != root or not VERSION_DIR.match(os.path.basename(path)):
            return f"weights path {ready.path!r} is not a version directory under the run's weights dir {root}"
        return None
    for endpoint, rank in [(ready.endpoint, 0)] + [(s.endpoint, s.rank) for s in ready.shards]:
        m = _ENDPOINT.match(endpoint)
        port_ok = m and (cfg.weight_server_port == 0 or int(m.group(2)) == cfg.weight_server_port + rank)
        host = rank_host(cfg, rank)
        if not m or m.group(1) != host or not port_ok:
            want = f"tcp://{host}:{cfg.weight_server_port + rank if cfg.weight_server_port else 'PORT'}"
            who = f"trainer rank {rank}'s" if ready.shards else "the trainer's"
            return f"weights endpoint {endpoint!r} is not {who} weight server ({want})"
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


def deltas_on(cfg: "TrainerConfig") -> bool:
    """Whether versions also travel as deltas (trainer.weight_deltas; auto: zmq yes, disk no)."""
    return cfg.weight_deltas == "on" or (cfg.weight_deltas == "auto" and cfg.publish_mode == "zmq")


class WeightPublisher:
    """Trainer-side publishing in the mode TrainerConfig chooses (disk dirs under run_dir/weights or
    a WeightServer), with deltas when `deltas_on(cfg)`. Call `publish` on the main rank only."""

    def __init__(self, cfg: "TrainerConfig", run_dir: str | Path, keys: Keyring | None = None, log: Any = None):
        self.cfg = cfg
        self.weights_dir = Path(run_dir) / "weights"
        self.deltas = deltas_on(cfg)
        self.server = None
        self.ipc = IpcPublisher(run_dir, cfg.publish_dtype) if cfg.publish_mode == "cuda_ipc" else None
        self._last: tuple[int, Mapping[str, Any]] | None = None  # disk: the previous version, the delta's base
        if cfg.publish_mode == "zmq":
            self.server = WeightServer(cfg.weight_server_host, cfg.weight_server_port, cfg.keep_weight_versions,
                                       int(cfg.weight_chunk_mb * (1 << 20)), keys=keys, log=log,
                                       deltas=self.deltas, chain=cfg.full_every)

    def publish(self, version: int, tensors: Mapping[str, "torch.Tensor"], hf_config_json: str | None = None,
                snapshot: bool = False) -> WeightsReady:
        """Publish `tensors` as `version`. They are copied first (unique_tensors in cfg.publish_dtype) unless
        `snapshot` says they already are such a copy (Trainer.publish_tensors). cuda_ipc takes the live parameters
        and copies them on their device into the shared buffers (weights/ipc.py)."""
        if self.ipc is not None:
            return self.ipc.publish(version, tensors)
        if not snapshot:
            tensors = unique_tensors(tensors, self.cfg.publish_dtype)
        if self.server is not None:
            return self.server.publish(version, tensors)
        if not self.deltas:
            return publish_disk(self.weights_dir, version, tensors, self.cfg.keep_weight_versions, hf_config_json)
        delta = None
        digests = {k: checksum(t) for k, t in tensors.items()}
        if self._last is not None and self._last[0] == version - 1 and same_layout(self._last[1], tensors):
            delta = DiskDelta(version - 1, encode_version(self._last[1], tensors, digests))
        full = delta is None or version % self.cfg.full_every == 0
        self._last = (version, tensors)
        return publish_disk(self.weights_dir, version, tensors, self.cfg.keep_weight_versions, hf_config_json,
                            delta=delta, full=full, digests=digests)

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
        if self.ipc is not None:
            self.ipc.close()
