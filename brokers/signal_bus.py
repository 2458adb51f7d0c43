"""Signal bus: an XSUB/XPUB proxy for the topics `weights`, `control` and `events`.

Publishers (trainer, launcher, every process's event publisher) connect PUB sockets to the XSUB side;
subscribers connect SUB sockets to the XPUB side. Frames: [topic, header, arrays...].

Retention: the bus remembers the latest WeightsReady (a resumed trainer may go back to an older version). Whenever a subscriber subscribes
to a prefix of "weights" (XPUB_VERBOSE shows every subscription), the bus sends the retained message
again — or WeightsReady(version=0, mode="base") if nothing was published yet — so a late joiner always
learns the current policy before it takes jobs. Receivers treat a version they already have as a no-op.
"""
from __future__ import annotations

from typing import Any

import zmq

from areal_mq import protocol
from areal_mq.errors import ProtocolError
from areal_mq.messages import WeightsReady

WEIGHTS = b"weights"


class SignalBus:
    def __init__(self, ctx: zmq.Context, in_address: str, out_address: str, *, max_frame_bytes: int, log: Any):
        self.xsub = ctx.socket(zmq.XSUB)
        self.xpub = ctx.socket(zmq.XPUB)
        for s in (self.xsub, self.xpub):
            s.setsockopt(zmq.LINGER, 0)
        self.xpub.setsockopt(zmq.XPUB_VERBOSE, 1)
        self.xpub.setsockopt(zmq.SNDHWM, 100_000)
        self.xsub.bind(in_address)
        self.xpub.bind(out_address)
        self.max_frame_bytes = max_frame_bytes
        self.log = log
        self.retained: list | None = None
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
            if sock is self.xsub:
                self._from_publisher(frames)
            else:
                self._from_subscriber(frames)

    def _from_publisher(self, frames: list) -> None:
        topic = frames[0].bytes if frames else b""
        if topic == WEIGHTS:
            try:
                _, env = protocol.decode_topic(frames, self.max_frame_bytes)
            except ProtocolError as exc:
                self.log.warning("bus.bad_weights_message", error=str(exc), code=exc.code)
                return
            # the latest announcement wins, even a lower version: a trainer that resumed from a checkpoint
            # republishes its older version, and late joiners must get that policy, not the lost one
            self.retained = [f.bytes for f in frames]
            self.log.info("bus.weights_retained", version=env.msg.version, mode=env.msg.mode)
        self.forwarded += 1
        self.xpub.send_multipart(frames, copy=False)

    def _from_subscriber(self, frames: list) -> None:
        data = frames[0].bytes
        self.xsub.send(data)  # forward (un)subscriptions upstream
        if data[:1] == b"\x01" and WEIGHTS.startswith(data[1:]):
            replay = self.retained or protocol.topic_frames("weights", WeightsReady(version=0, mode="base"))
            self.xpub.send_multipart(replay)

    def close(self) -> None:
        self.xsub.close(0)
        self.xpub.close(0)
