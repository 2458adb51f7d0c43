"""A reward worker written from docs/protocol.md alone: raw pyzmq + msgpack, no areal_mq import.

What: registers with the job broker (READY), heartbeats, serves `reward_job` jobs and answers each with a
`reward_result` (or an `error`), drains on SIGTERM (READY capacity 0, then DISCONNECT). It proves that the
protocol document is enough to implement a peer in another language; keep it free of areal_mq imports.
Rewards, by `task`: "exact" -> 1.0 if the stripped completion equals str(reference) else 0.0;
"length" -> len(completion). Any other task is answered with error code "job_failed".

CURVE (docs/protocol.md §2.1): with `--keys DIR` it authenticates with DIR/reward.key_secret against the
brokers' DIR/broker.key, read as the text files they are (no helper library).

With `--tasks exact,length` its READY lists the tasks it serves (§5.2), so the broker sends it only those.

Run: python tests/integration/raw_worker.py tcp://127.0.0.1:5555 [--worker-id raw-0] [--capacity 2]
     [--heartbeat-s 1.0] [--liveness 5] [--keys RUN_DIR/keys] [--tasks exact,length]
     (--heartbeat-s 0: no heartbeats, a liveness test)
"""
from __future__ import annotations

import argparse
import re
import signal
import time
import uuid

import msgpack
import zmq

PROTOCOL_VERSION = 1


def pack(kind: str, body: dict, reply_to: str = "") -> list[bytes]:
    """One message without arrays: a single header frame (docs/protocol.md §3)."""
    header = {"v": PROTOCOL_VERSION, "kind": kind, "id": uuid.uuid4().hex, "reply_to": reply_to,
              "service": "", "body": body, "arrays": []}
    return [msgpack.packb(header, use_bin_type=True)]


def read_key(path: str, which: str) -> bytes:
    """The Z85 `public-key` or `secret-key` of a ZeroMQ certificate file (docs/protocol.md §2.1)."""
    with open(path) as f:
        found = re.search(which + r'\s*=\s*"([^"]{40})"', f.read())
    if not found:
        raise SystemExit(f"{path}: no {which}")
    return found.group(1).encode()


def score(task: str, completion: str, reference) -> float:
    if task == "exact":
        return 1.0 if completion.strip() == str(reference) else 0.0
    if task == "length":
        return float(len(completion))
    raise ValueError(f"raw worker has no reward task {task!r}; it knows 'exact' and 'length'")


def answer(header: dict, worker_id: str) -> list[bytes]:
    """The reply to one job: reward_result, or error with reply_to/ref_id = the job id (§5.2)."""
    job_id = header["id"]
    if header.get("kind") != "reward_job":
        return pack("error", {"code": "bad_request", "ref_id": job_id,
                              "message": f"raw worker serves reward_job, got {header.get('kind')!r}"}, job_id)
    body = header.get("body", {})
    try:
        rewards = [score(body["task"], c, body.get("reference")) for c in body["completions"]]
    except (KeyError, TypeError, ValueError) as exc:
        return pack("error", {"code": "job_failed", "message": str(exc), "ref_id": job_id}, job_id)
    details = [{"served_by": "raw-python"} for _ in rewards]
    return pack("reward_result", {"rewards": rewards, "details": details, "worker_id": worker_id}, job_id)


class RawWorker:
    def __init__(self, address: str, worker_id: str, capacity: int, heartbeat_s: float, liveness: int,
                 keys_dir: str | None = None, tasks: list[str] | None = None):
        self.address, self.worker_id, self.capacity = address, worker_id, capacity
        self.tasks = tasks or []
        self.keys_dir = keys_dir
        self.heartbeat_s, self.liveness = heartbeat_s, liveness
        self.ctx = zmq.Context()
        self.sock = None
        self.stopping = False
        self.served = 0

    def connect(self) -> None:
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        if self.keys_dir:
            own = f"{self.keys_dir}/reward.key_secret"
            self.sock.curve_secretkey = read_key(own, "secret-key")
            self.sock.curve_publickey = read_key(own, "public-key")
            self.sock.curve_serverkey = read_key(f"{self.keys_dir}/broker.key", "public-key")
        self.sock.connect(self.address)
        self.ready()

    def ready(self) -> None:
        self.send(pack("ready", {"service": "reward", "capacity": self.capacity, "worker_id": self.worker_id,
                                 "role": "reward", "tasks": self.tasks}))

    def send(self, frames: list[bytes]) -> None:
        self.sock.send_multipart(frames)

    def run(self) -> None:
        self.connect()
        beat_every = self.heartbeat_s if self.heartbeat_s > 0 else None
        silence_limit = (self.heartbeat_s or 1.0) * self.liveness
        last_heard = next_beat = time.monotonic()
        backoff, beats = self.heartbeat_s or 1.0, 0
        while not self.stopping:
            if self.sock.poll(50, zmq.POLLIN):
                last_heard = time.monotonic()
                self.drain()
            now = time.monotonic()
            if beat_every and now >= next_beat:
                next_beat, beats = now + beat_every, beats + 1
                self.send(pack("heartbeat", {"peer_id": self.worker_id}))
                if beats % self.liveness == 0:  # re-announce once per liveness window (§5.4)
                    self.ready()
            if beat_every and now - last_heard > silence_limit:  # broker gone: new socket, READY again
                self.sock.close(0)
                time.sleep(backoff)
                backoff = min(backoff * 2, 8.0)
                self.connect()
                last_heard = time.monotonic()

    def drain(self) -> None:
        while True:
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                header = msgpack.unpackb(frames[0], raw=False)
            except Exception:
                continue  # nothing to answer: without a readable id the broker could not route a reply
            if not isinstance(header, dict) or header.get("kind") in ("heartbeat", "error"):
                continue
            self.send(answer(header, self.worker_id))
            self.served += 1

    def close(self) -> None:
        """Drain (capacity 0), then leave: the broker requeues nothing because nothing is held."""
        if self.sock is not None:
            self.send(pack("ready", {"service": "reward", "capacity": 0, "worker_id": self.worker_id}))
            self.send(pack("disconnect", {"reason": f"sigterm after {self.served} jobs"}))
            self.sock.close(linger=2000)  # sends both before closing (up to 2 s), instead of a fixed sleep
        self.ctx.term()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("address")
    parser.add_argument("--worker-id", default=f"raw-{uuid.uuid4().hex[:6]}")
    parser.add_argument("--capacity", type=int, default=2)
    parser.add_argument("--heartbeat-s", type=float, default=1.0)
    parser.add_argument("--liveness", type=int, default=5)
    parser.add_argument("--keys", default=None, help="key directory (CURVE); plaintext without it")
    parser.add_argument("--tasks", default="", help="comma-separated tasks to advertise (default: any)")
    args = parser.parse_args()
    worker = RawWorker(args.address, args.worker_id, args.capacity, args.heartbeat_s, args.liveness, args.keys,
                       [t for t in args.tasks.split(",") if t])

    def stop(*_):
        worker.stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    print(f"raw worker {args.worker_id} connecting to {args.address}", flush=True)
    try:
        worker.run()
    finally:
        worker.close()
        print(f"raw worker {args.worker_id} stopped after {worker.served} jobs", flush=True)


if __name__ == "__main__":
    main()
