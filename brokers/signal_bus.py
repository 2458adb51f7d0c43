"""Signal bus: an XSUB/XPUB proxy for the topics `weights`, `control` and `events`.

Publishers (trainer, launcher, every process's event publisher) connect PUB sockets to the XSUB side;
subscribers connect SUB sockets to the XPUB side. Frames: [topic, header, arrays...].

Retention: the bus remembers the latest WeightsReady (a resumed trainer may go back to an older version). Whenever a subscriber subscribes
to a prefix of "weights" (XPUB_VERBOSE shows every subscription), the bus sends the retained message
again — or WeightsReady(version=0, mode="base") if nothing was published yet — so a late joiner always
learns the current policy before it takes jobs. Receivers treat a version they already have as a no-op.

Limits: ZMQ_MAXMSGSIZE on the XSUB side drops any frame over max_frame_bytes + the header limit at the socket.
Authorization (with CURVE keys): a publisher may only publish the topics its role owns — `weights`
the trainer, `control` the launcher and controller, `events` anyone with a key — and a WeightsReady
must name this run's weights directory or the trainer's weight server (weights.check_ready). Anything
else is dropped (PUB/SUB has no way to answer) and logged, rate-limited; it is never retained.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import msgpack
import zmq

from areal_mq import protocol
from areal_mq.errors import ProtocolError
from areal_mq.messages import Control, Event, WeightsReady
from areal_mq.security import Keyring, RateLimited, peer_role, refusal

WEIGHTS = b"weights"
TOPICS = {b"weights": ("publish:weights", WeightsReady), b"control": ("publish:control", Control),
          b"events": ("publish:events", Event)}


class SignalBus:
    def __init__(self, ctx: zmq.Context, in_address: str, out_address: str, *, max_frame_bytes: int, log: Any,
                 keys: Keyring | None = None, check_weights: Any = None, retain_path: Path | None = None):
        """`check_weights(WeightsReady) -> str | None` says what is wrong with an announcement (None: fine).
        `retain_path`: where the retained WeightsReady is kept, so a restarted bus replays the current policy
        rather than "base" (a worker joining after a broker restart would otherwise wait for a version that
        only the next training step brings)."""
        self.xsub = ctx.socket(zmq.XSUB)
        self.xpub = ctx.socket(zmq.XPUB)
        self.secure = keys is not None and keys.secure
        for s, address in ((self.xsub, in_address), (self.xpub, out_address)):
            s.setsockopt(zmq.LINGER, 0)
            if keys is not None:
                keys.server(s, address)
        self.check_weights = check_weights
        self.refusals = RateLimited(log)
        self.refused = 0
        self.xpub.setsockopt(zmq.XPUB_VERBOSE, 1)
        self.xpub.setsockopt(zmq.SNDHWM, 100_000)
        # A larger publication is dropped by ZeroMQ as it arrives (the publisher's connection is closed and
        # reconnects), never buffered whole; smaller bad ones are refused below.
        self.xsub.setsockopt(zmq.MAXMSGSIZE, max_frame_bytes + protocol.MAX_HEADER_BYTES)
        self.xsub.bind(in_address)
        self.xpub.bind(out_address)
        self.max_frame_bytes = max_frame_bytes
        self.log = log
        self.retain_path = retain_path
        self.retained: list | None = self._load_retained()
        self.forwarded = 0

    @property
    def sockets(self) -> list:
        return [self.xsub, self.xpub]

    def handle(self, sock: zmq.Socket) -> None:
        for _ in range(256):
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            try:
                if sock is self.xsub:
                    self._from_publisher(frames)
                else:
                    self._from_subscriber(frames)
            except Exception as exc:  # noqa: BLE001 - a bug must not end the poll loop: drop it, log it, go on
                self.refused += 1
                self.refusals.error("bus.internal_error", key=f"internal:{type(exc).__name__}",
                                    error=f"{type(exc).__name__}: {str(exc)[:300]}", where=protocol.where(exc))

    def _from_publisher(self, frames: list) -> None:
        topic = frames[0].bytes if frames else b""
        why, env = self._refusal(topic, frames)
        if why:
            self.refused += 1
            self.refusals.warning("bus.refused", key=topic[:32].decode(errors="replace"),
                                  topic=topic[:32].decode(errors="replace"), error=why)
            return
        if topic == WEIGHTS:
            # the latest announcement wins, even a lower version: a trainer that resumed from a checkpoint
            # republishes its older version, and late joiners must get that policy, not the lost one
            self.retained = [f.bytes for f in frames]
            self._save_retained()
            self.log.info("bus.weights_retained", version=env.msg.version, mode=env.msg.mode)
        self.forwarded += 1
        self.xpub.send_multipart(frames, copy=False)

    def _refusal(self, topic: bytes, frames: list) -> tuple[str | None, Any]:
        """(why this publication may not be forwarded or None, its decoded envelope when it was decoded)."""
        if topic not in TOPICS:
            return f"unknown topic {topic[:32]!r}; topics: {', '.join(t.decode() for t in TOPICS)}", None
        action, kind = TOPICS[topic]
        why = refusal(peer_role(frames[0], self.secure), action)
        if why or topic == b"events":
            return why, None  # events are only relayed; subscribers decode and check them
        try:
            _, env = protocol.decode_topic(frames, self.max_frame_bytes)
        except ProtocolError as exc:
            return f"[{exc.code}] {exc}", None
        if not isinstance(env.msg, kind):
            return f"topic {topic.decode()} carries {kind.__name__}, got {env.msg.kind.value}", env
        if kind is WeightsReady and self.check_weights is not None:
            return self.check_weights(env.msg), env
        return None, env

    def _from_subscriber(self, frames: list) -> None:
        data = frames[0].bytes
        self.xsub.send(data)  # forward (un)subscriptions upstream
        if data[:1] == b"\x01" and WEIGHTS.startswith(data[1:]):
            replay = self.retained or protocol.topic_frames("weights", WeightsReady(version=0, mode="base"))
            self.xpub.send_multipart(replay)

    def _save_retained(self) -> None:
        if self.retain_path is None:
            return
        self.retain_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.retain_path.with_suffix(".tmp")
        tmp.write_bytes(msgpack.packb(self.retained, use_bin_type=True))
        tmp.replace(self.retain_path)

    def _load_retained(self) -> list | None:
        """The last retained WeightsReady of this run, checked like a new publication; None if absent or bad."""
        if self.retain_path is None or not self.retain_path.exists():
            return None
        try:
            frames = msgpack.unpackb(self.retain_path.read_bytes(), raw=False)
            _, env = protocol.decode_topic(frames, self.max_frame_bytes)
            why = self.check_weights(env.msg) if self.check_weights and isinstance(env.msg, WeightsReady) else None
            if not isinstance(env.msg, WeightsReady) or why:
                raise ValueError(why or "not a WeightsReady")
        except Exception as exc:  # noqa: BLE001 - a damaged file only loses the replay, never the bus
            self.log.warning("bus.retained_unreadable", path=str(self.retain_path), error=str(exc)[:200])
            return None
        self.log.info("bus.weights_restored", version=env.msg.version, mode=env.msg.mode)
        return frames

    def close(self) -> None:
        self.xsub.close(0)
        self.xpub.close(0)
