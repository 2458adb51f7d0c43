"""The signal bus drops an oversized publication at its XSUB socket (ZMQ_MAXMSGSIZE) instead of reading it
whole; the publisher's connection is closed, it reconnects by itself, and smaller messages flow again."""
from __future__ import annotations

import time

import zmq

from areal_mq import protocol
from areal_mq.brokers.signal_bus import SignalBus
from areal_mq.messages import Event
from areal_mq.testing import RecordingLog

from .procs import free_ports


def test_a_publication_over_the_socket_limit_never_reaches_subscribers():
    ctx = zmq.Context()
    bus_in, bus_out = (f"tcp://127.0.0.1:{p}" for p in free_ports(2))
    bus = SignalBus(ctx, bus_in, bus_out, max_frame_bytes=10_000, log=RecordingLog())
    pub, sub = ctx.socket(zmq.PUB), ctx.socket(zmq.SUB)
    for s in (pub, sub):
        s.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"events")
    sub.connect(bus_out)
    pub.connect(bus_in)
    poller = zmq.Poller()
    for s in bus.sockets:
        poller.register(s, zmq.POLLIN)

    def pump(seconds):
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            for s, _ in poller.poll(20):
                bus.handle(s)

    def received(seconds):
        got = []
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            pump(0.02)
            while sub.poll(0, zmq.POLLIN):
                got.append(sub.recv_multipart())
        return got

    try:
        small = protocol.topic_frames("events", Event(record={"event": "x.small"}))
        big_size = 10_000 + protocol.MAX_HEADER_BYTES + 1
        big = [b"events", *protocol.encode(Event(record={"event": "x.big", "pad": "p" * big_size}))]
        delivered = []
        deadline = time.monotonic() + 10
        while not delivered and time.monotonic() < deadline:  # PUB/SUB: wait until the path is up
            pub.send_multipart(small)
            delivered = received(0.2)
        assert delivered, "small events never arrived"
        received(0.3)  # drain
        pub.send_multipart(big)
        got = received(1.5)
        assert all(len(m[1]) < big_size for m in got), "the oversized event was read whole and forwarded"
        again = []
        deadline = time.monotonic() + 10
        while not again and time.monotonic() < deadline:  # the publisher reconnected by itself
            pub.send_multipart(small)
            again = received(0.2)
        assert again and protocol.decode_topic(again[0])[1].msg.record["event"] == "x.small"
    finally:
        pub.close(0)
        sub.close(0)
        bus.close()
        ctx.term()
