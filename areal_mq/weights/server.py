"""The trainer's weight server: published versions served over a ROUTER socket from a background thread.

What: `WeightServer` binds (127.0.0.1 by default) and answers WeightsFetch(version, index, base) with pre-encoded
WeightsChunk frames (codec.py); the last `keep` versions stay fetchable in full, and with deltas each version is also
served as a delta from the previous one (the last `chain` deltas). With CURVE keys it uses the trainer's key pair, and
only roles allowed "weights:fetch" (security.PERMISSIONS) are served; one bad request never ends its thread.
`rank_host(cfg, rank)`: the address trainer rank `rank`'s server binds (client.py's check_ready accepts only those).
Used by publisher.py (one server per trainer) and sharded.py (one per rank); tests in tests/unit/test_weights.py.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from typing import TYPE_CHECKING, Any, Mapping

from areal_mq.errors import ProtocolError, WeightsFetchError
from areal_mq.messages import Error, WeightsChunk, WeightsFetch, WeightsLink, WeightsReady
from areal_mq.security import Keyring, peer_role, refusal, start_zap
from areal_mq.weights.codec import make_chunks, make_delta_chunks, same_layout
from areal_mq.weights.delta import checksum, encode_version

if TYPE_CHECKING:
    import torch

    from areal_mq.algorithms.config import TrainerConfig


def rank_host(cfg: "TrainerConfig", rank: int) -> str:
    """The address trainer rank `rank`'s weight server binds: trainer.weight_server_hosts[rank] when the trainer
    spans hosts, else trainer.weight_server_host (a rank past the list gets no address anyone accepts)."""
    if not cfg.weight_server_hosts:
        return cfg.weight_server_host
    return cfg.weight_server_hosts[rank] if 0 <= rank < len(cfg.weight_server_hosts) else "(no such rank)"


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
