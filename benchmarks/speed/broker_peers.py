"""Peer processes for benchmarks/speed/broker.py: a raw pyzmq echo worker and a swarm of heartbeating workers.

What:
- `echo`: one process that answers GenerateRequest-shaped jobs two ways at once — as a worker registered
  with the job broker (DEALER, routed mode) and on its own ROUTER (direct mode, the baseline). Both paths
  run the same reply code (msgpack header + a 512-token GenerateResult whose output_ids are the first
  tokens of the job), so the only difference between the modes is the broker hop.
- `swarm`: N DEALER sockets in one process, each registered as an idle worker (service "idle") and sending
  HEARTBEAT every heartbeat_s (staggered); it measures the broker's heartbeat answer times and prints them
  as one JSON line on exit.
Why raw pyzmq + msgpack (docs/protocol.md) and not the worker runtime: the benchmark measures the broker,
so the peers must be as cheap as possible. Run through benchmarks/speed/broker.py, or by hand:

    python benchmarks/speed/broker_peers.py echo tcp://127.0.0.1:5555 tcp://127.0.0.1:6000 --heartbeat-s 1
    python benchmarks/speed/broker_peers.py swarm tcp://127.0.0.1:5555 --workers 1000 --heartbeat-s 1
"""
from __future__ import annotations

import argparse
import itertools
import json
import signal
import time

import msgpack
import numpy as np
import zmq
import zmq.auth

REPLY_TOKENS = 512
_LOGPROBS = np.zeros(REPLY_TOKENS, np.float32).tobytes()
_VERSIONS = np.zeros(REPLY_TOKENS, np.int32).tobytes()


def header(kind: str, msg_id: str, body: dict, reply_to: str = "", arrays: list | None = None) -> bytes:
    return msgpack.packb({"v": 1, "kind": kind, "id": msg_id, "reply_to": reply_to, "service": "",
                          "body": body, "arrays": arrays or []}, use_bin_type=True)


class Stopper:
    def __init__(self) -> None:
        self.stop = False
        signal.signal(signal.SIGTERM, self.set)
        signal.signal(signal.SIGINT, self.set)

    def set(self, *_: object) -> None:
        self.stop = True


def echo_reply(frames: list, ids: itertools.count) -> list | None:
    """Reply frames for one job (without routing), or None for heartbeats/errors from the broker."""
    head = msgpack.unpackb(frames[0].buffer, raw=False)
    if head.get("kind") in ("heartbeat", "error"):
        return None
    tokens = frames[1].buffer if len(frames) > 1 else memoryview(b"")
    n = min(REPLY_TOKENS, tokens.nbytes // 4)
    body = {"output_ids": {"__nd__": 0}, "logprobs": {"__nd__": 1}, "versions": {"__nd__": 2},
            "finish_reason": "length", "worker_id": "bench-echo"}
    arrays = [["int32", [n]], ["float32", [n]], ["int32", [n]]]
    return [header("generate_result", f"{next(ids):032x}", body, head["id"], arrays), tokens[:n * 4],
            _LOGPROBS[:n * 4], _VERSIONS[:n * 4]]


def _socket(ctx: zmq.Context, kind: int, keys_dir: str | None = None, server: bool = False) -> zmq.Socket:
    """A socket with the benchmark's options; with `keys_dir`, CURVE as the run's `echo` key (a client of the
    brokers, or with `server` the CURVE server of the direct path)."""
    sock = ctx.socket(kind)
    if keys_dir:
        public, secret = zmq.auth.load_certificate(f"{keys_dir}/echo.key_secret")
        sock.curve_secretkey, sock.curve_publickey = secret, public
        if server:
            sock.curve_server = True
        else:
            sock.curve_serverkey = zmq.auth.load_certificate(f"{keys_dir}/broker.key")[0]
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    return sock


def run_echo(job_addr: str, direct_addr: str, heartbeat_s: float, capacity: int, keys_dir: str | None) -> None:
    ctx, stopper, ids = zmq.Context(), Stopper(), itertools.count()
    router, dealer = _socket(ctx, zmq.ROUTER, keys_dir, server=True), _socket(ctx, zmq.DEALER, keys_dir)
    router.bind(direct_addr)
    dealer.connect(job_addr)
    ready = header("ready", "ready-0", {"service": "bench", "capacity": capacity, "worker_id": "bench-echo",
                                        "role": "bench"})
    dealer.send(ready)
    beats = 0
    poller = zmq.Poller()
    poller.register(router, zmq.POLLIN)
    poller.register(dealer, zmq.POLLIN)
    next_beat = time.monotonic()
    print("echo ready", flush=True)
    while not stopper.stop:
        events = dict(poller.poll(int(heartbeat_s * 250)))
        for _ in range(256 if router in events else 0):
            try:
                frames = router.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            reply = echo_reply(frames[1:], ids)
            if reply is not None:
                router.send_multipart([frames[0], *reply], copy=False)
        for _ in range(256 if dealer in events else 0):
            try:
                frames = dealer.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            reply = echo_reply(frames, ids)
            if reply is not None:
                dealer.send_multipart(reply, copy=False)
        if time.monotonic() >= next_beat:
            next_beat, beats = time.monotonic() + heartbeat_s, beats + 1
            dealer.send(header("heartbeat", f"hb-{next(ids)}", {"peer_id": "bench-echo"}))
            if beats % 5 == 0:  # re-announce once per liveness window (docs/protocol.md §5.4)
                dealer.send(ready)
    dealer.send(header("disconnect", "bye", {"reason": "benchmark finished"}))
    time.sleep(0.05)
    router.close(0)
    dealer.close(0)
    ctx.term()


def run_swarm(job_addr: str, workers: int, heartbeat_s: float, keys_dir: str | None) -> None:
    ctx, stopper = zmq.Context(), Stopper()
    ctx.set(zmq.MAX_SOCKETS, workers + 64)
    socks, poller = [], zmq.Poller()
    for i in range(workers):
        sock = _socket(ctx, zmq.DEALER, keys_dir)
        sock.connect(job_addr)
        sock.send(header("ready", f"ready-{i}", {"service": "idle", "capacity": 1, "worker_id": f"swarm-{i}",
                                                 "role": "idle"}))
        poller.register(sock, zmq.POLLIN)
        socks.append(sock)
    index = {s: i for i, s in enumerate(socks)}
    sent_at = [0.0] * workers
    rtts: list[float] = []
    step, nxt, next_time, sent = heartbeat_s / workers, 0, time.monotonic(), 0
    print("swarm ready", flush=True)
    while not stopper.stop:
        now = time.monotonic()
        while next_time <= now:  # staggered: socket i beats at offset i * heartbeat_s / workers
            socks[nxt].send(header("heartbeat", f"hb-{sent}", {"peer_id": f"swarm-{nxt}"}))
            sent_at[nxt], nxt, next_time, sent = now, (nxt + 1) % workers, next_time + step, sent + 1
        for sock, _ in poller.poll(max(0, int((next_time - time.monotonic()) * 1000))):
            while True:
                try:
                    sock.recv(zmq.NOBLOCK)  # single-frame heartbeat answers
                except zmq.Again:
                    break
                rtts.append(time.monotonic() - sent_at[index[sock]])
    arr = np.array(rtts or [0.0]) * 1000
    print(json.dumps({"heartbeats_sent": sent, "answers": len(rtts), "rtt_p50_ms": float(np.percentile(arr, 50)),
                      "rtt_p99_ms": float(np.percentile(arr, 99))}), flush=True)
    for sock in socks:
        sock.close(0)
    ctx.term()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("echo")
    e.add_argument("job_addr")
    e.add_argument("direct_addr")
    e.add_argument("--heartbeat-s", type=float, default=1.0)
    e.add_argument("--capacity", type=int, default=4096)  # brokers.max_worker_capacity
    s = sub.add_parser("swarm")
    s.add_argument("job_addr")
    s.add_argument("--workers", type=int, default=1000)
    s.add_argument("--heartbeat-s", type=float, default=1.0)
    for p in (e, s):
        p.add_argument("--keys", default=None, help="run key directory: CURVE as its echo key (plaintext without)")
    args = parser.parse_args()
    if args.cmd == "echo":
        run_echo(args.job_addr, args.direct_addr, args.heartbeat_s, args.capacity, args.keys)
    else:
        run_swarm(args.job_addr, args.workers, args.heartbeat_s, args.keys)


if __name__ == "__main__":
    main()
