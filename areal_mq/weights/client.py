"""What a receiver does with a WeightsReady: check where it points, fetch it, and resolve it for an engine.

What: `check_ready(ready, run_dir, cfg)` (a WeightsReady may only name a version directory under the run's weights
directory or the trainer's configured weight-server addresses, server.py's `rank_host` per rank; the bus and every
rollout worker check); `fetch_chunks` / `fetch_weights` / `fetch_delta` (a piece from a WeightServer, two chunks
in flight, WeightsFetchError within the deadline, never a hang; checksums verified); `fetch_piece` (one piece of a
catch-up plan, from disk or the server: the one place a receiver tells the two apart); `load_published` (any
mode's tensors) and `engine_kwargs` (the keyword argument of Engine.update_weights; `resolve` checks first). Used by
catchup.py and the rollout worker; tests in tests/unit/test_weights.py.
"""
from __future__ import annotations

import os
import re
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from areal_mq.errors import ProtocolError, WeightsFetchError, WeightsRefused
from areal_mq.messages import Error, WeightsChunk, WeightsFetch, WeightsLink, WeightsReady
from areal_mq.security import Keyring
from areal_mq.weights.codec import bytes_tensor, chunk_deltas
from areal_mq.weights.delta import DeltaError, TensorDelta
from areal_mq.weights.disk import DELTA_FILE, VERSION_DIR, DiskDelta, read_disk
from areal_mq.weights.ipc import check_ready_ipc
from areal_mq.weights.server import rank_host

if TYPE_CHECKING:
    import torch

    from areal_mq.algorithms.config import TrainerConfig


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


def fetch_piece(ready: WeightsReady, piece: WeightsLink, left: Callable[[str], float],
                keys: Keyring | None = None) -> Any:
    """One piece a catch-up plan lists (catchup.py), from where `ready` says its versions are (the version directories
    on disk, or the weight server): a full version's tensors (piece.base -1) or the TensorDeltas piece.base ->
    piece.version. `left(what)`: the seconds left for a fetch from the server (raises past the deadline). Raises
    DeltaError (missing, corrupt, checksum: another plan may do) or WeightsFetchError."""
    where = Path(ready.path).parent / f"v{piece.version}" if ready.mode == "disk" else None
    if piece.base >= 0:
        if where is not None:
            return DiskDelta.read(where / DELTA_FILE, piece.version, piece.base)
        return fetch_delta(ready.endpoint, piece.version, piece.base, piece.chunks, left(f"delta v{piece.version}"),
                           keys)
    if where is None:
        at = ready.model_copy(update={"version": piece.version, "num_chunks": piece.chunks})
        return fetch_weights(at, left(f"full v{piece.version}"), keys=keys)
    try:
        return read_disk(where, verify_checksums=True)
    except DeltaError:
        raise
    except WeightsFetchError as exc:
        raise DeltaError("missing", str(exc)) from None
    except Exception as exc:  # safetensors' own errors on a damaged file
        raise DeltaError("corrupt", f"cannot read {where}: {type(exc).__name__}: {exc}") from None


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
    """The keyword argument of Engine.update_weights for `ready` (`engine_kwargs`), after `check_ready`.
    Raises WeightsRefused when it points outside this run, WeightsFetchError when the zmq fetch fails."""
    why = check_ready(ready, run_dir, cfg)
    if why:
        raise WeightsRefused(why)
    return engine_kwargs(ready, timeout_s, keys)


def engine_kwargs(ready: WeightsReady, timeout_s: float = 60.0, keys: Keyring | None = None) -> dict[str, Any]:
    """The keyword argument of Engine.update_weights for a checked `ready`: {"path": ...} for a disk version (a LoRA
    adapter is small and merged, not loaded: its {"tensors": ...} are read here), {} where nothing is fetched (sim;
    cuda_ipc: the worker copies the shared buffers, weights.ipc.IpcReceiver), else the tensors from the server."""
    if ready.mode == "disk":
        return {"path": ready.path} if ready.adapter is None else {"tensors": read_disk(ready.path)}
    if ready.mode in ("sim", "cuda_ipc"):
        return {}
    return {"tensors": load_published(ready, timeout_s, keys)}


_ENDPOINT = re.compile(r"^tcp://(.+):(\d{1,5})$")


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
