"""Job broker: Majordomo-style service routing with credit-based dispatch and requeue on worker loss.

Dataflow:

    client (DEALER) --job(service)--> ROUTER --job--> worker with most free credit (DEALER)
    client <--------- reply ---------  ROUTER <--reply(reply_to=job id)-- worker

Invariants:
- every accepted job is answered to its client exactly once: a reply is forwarded only if it comes from
  the worker the job is currently assigned to; late replies from a worker declared dead are dropped;
- a worker never holds more jobs than the capacity it announced in READY (credits are the backpressure);
- a worker that misses `liveness` heartbeats, or says DISCONNECT, has its in-flight jobs requeued at the
  front of their service queue;
- a queue holds at most `max_queue` jobs; beyond that the client gets Error(queue_full) at once;
- undecodable or invalid messages are answered with Error naming the problem; the broker keeps serving;
- with CURVE keys, a peer may only say what its role owns (security.refusal): only worker roles register,
  only for their own services and up to `max_capacity`; only the controller (agent, launcher) submits jobs.
  Anything else is answered with Error(forbidden) and logged, rate-limited.
Who waits on whom: nobody waits on the broker except through credits; the broker waits on nothing.
"""
from __future__ import annotations

import collections
import time
from dataclasses import dataclass, field
from typing import Any

import zmq

from areal_mq import protocol
from areal_mq.errors import ProtocolError
from areal_mq.messages import Error, Heartbeat, Kind, Stats
from areal_mq.security import Keyring, RateLimited, peer_role, refusal

DEFAULT_SERVICE = {Kind.GENERATE_REQUEST: "generate", Kind.REWARD_JOB: "reward"}
REPLY_KINDS = {Kind.GENERATE_RESULT, Kind.REWARD_RESULT, Kind.ERROR}
# Plain-int socket flags: pyzmq's flag enums cost an Enum operation per frame on the hot path.
_NOBLOCK, _SNDMORE = int(zmq.NOBLOCK), int(zmq.SNDMORE)


@dataclass
class WorkerState:
    ident: bytes
    worker_id: str
    service: str
    capacity: int
    last_seen: float
    in_flight: set[str] = field(default_factory=set)

    @property
    def free(self) -> int:
        return self.capacity - len(self.in_flight)


@dataclass
class JobState:
    id: str
    client: bytes
    service: str
    frames: list[Any]
    worker: bytes | None = None
    attempts: int = 0


class JobBroker:
    """Owns one ROUTER socket. Driven by a BrokerHost poll loop: `handle()` on input, `tick()` on time."""

    def __init__(self, ctx: zmq.Context, address: str, *, heartbeat_s: float, liveness: int, max_queue: int,
                 max_frame_bytes: int, log: Any, keys: Keyring | None = None, max_capacity: int = 4096):
        self.sock = ctx.socket(zmq.ROUTER)
        self.secure = keys is not None and keys.secure
        if keys is not None:
            keys.server(self.sock)
        self.max_capacity = max_capacity
        self.refusals = RateLimited(log)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
        self.sock.setsockopt(zmq.SNDHWM, 0)
        self.sock.setsockopt(zmq.RCVHWM, 0)
        self.sock.bind(address)
        self.heartbeat_s, self.liveness, self.max_queue = heartbeat_s, liveness, max_queue
        self.max_frame_bytes = max_frame_bytes
        self.log = log
        self.workers: dict[bytes, WorkerState] = {}
        self.by_service: dict[str, dict[bytes, WorkerState]] = collections.defaultdict(dict)  # dispatch index
        self.queues: dict[str, collections.deque[str]] = collections.defaultdict(collections.deque)
        self.jobs: dict[str, JobState] = {}
        self.counters: collections.Counter = collections.Counter()
        self._next_check = 0.0

    # ------------------------------------------------------------ input
    def handle(self) -> None:
        """Process every message waiting on the socket (bounded batch to stay fair to other sockets)."""
        sock = self.sock
        for _ in range(256):
            try:
                frame = sock.recv(_NOBLOCK, copy=False)
            except zmq.Again:
                return
            raw = [frame]
            while frame.more:  # a multipart message arrives whole: the rest is already here
                frame = sock.recv(_NOBLOCK, copy=False)
                raw.append(frame)
            self._on_message(raw)

    def _on_message(self, raw: list) -> None:
        try:
            ident, frames = protocol.split_router(raw)
        except ProtocolError:
            self.counters["bad_frames"] += 1
            return
        try:
            header = protocol.decode_header(frames, self.max_frame_bytes)
            kind = header["kind"]
            if kind == Kind.HEARTBEAT:
                self._on_heartbeat(ident)
                return
            env = protocol.decode_body(header, frames)
        except ProtocolError as exc:
            self._refuse(ident, exc)
            return
        self._dispatch_kind(ident, env, frames, peer_role(raw[0], self.secure))

    def _dispatch_kind(self, ident: bytes, env: protocol.Envelope, frames: list, role: str | None = None) -> None:
        kind = env.kind
        why = self._not_allowed(env, role)
        if why:
            self._forbid(ident, env, role, why)
        elif kind == Kind.READY:
            self._on_ready(ident, env.msg)
        elif kind == Kind.DISCONNECT:
            self._drop_worker(ident, f"disconnect: {env.msg.reason}")
        elif kind in REPLY_KINDS and env.reply_to and ident in self.workers:
            self._on_reply(ident, env, frames)
        elif kind == Kind.STATS_REQUEST:
            self._send(ident, protocol.encode(Stats(data=self.stats()), reply_to=env.id))
        elif kind in REPLY_KINDS:
            self.counters["orphan_replies"] += 1  # from an unknown worker (e.g. before a broker restart)
        else:
            self._on_job(ident, env, frames)

    def _not_allowed(self, env: protocol.Envelope, role: str | None) -> str | None:
        kind = env.kind
        if kind == Kind.READY:
            if env.msg.capacity > self.max_capacity:
                return f"capacity {env.msg.capacity} exceeds brokers.max_worker_capacity ({self.max_capacity})"
            return refusal(role, f"serve:{env.msg.service}")
        if kind in (Kind.DISCONNECT, Kind.STATS_REQUEST) or kind in REPLY_KINDS:
            return None  # a disconnect or reply only concerns the sender's own registration and jobs
        return refusal(role, "submit")

    def _forbid(self, ident: bytes, env: protocol.Envelope, role: str | None, why: str) -> None:
        self.counters["forbidden"] += 1
        self.refusals.warning("broker.forbidden", key=f"{role}:{env.kind.value}", role=role,
                              kind=env.kind.value, error=why)
        self._send(ident, protocol.encode(Error(code="forbidden", message=why, ref_id=env.id), reply_to=env.id))

    def _refuse(self, ident: bytes, exc: ProtocolError) -> None:
        self.counters["refused"] += 1
        self.log.warning("broker.bad_message", code=exc.code, error=str(exc), peer=ident.hex())
        self._send(ident, protocol.error_reply(exc))

    def _on_heartbeat(self, ident: bytes) -> None:
        worker = self.workers.get(ident)
        if worker is not None:
            worker.last_seen = time.monotonic()
        self._send(ident, protocol.encode(Heartbeat(peer_id="broker")))

    def _on_ready(self, ident: bytes, msg: Any) -> None:
        worker = self.workers.get(ident)
        if worker is None:
            worker = WorkerState(ident, msg.worker_id, msg.service, msg.capacity, time.monotonic())
            self.workers[ident] = worker
            self.by_service[msg.service][ident] = worker
            self.log.info("broker.worker_ready", worker=msg.worker_id, service=msg.service, capacity=msg.capacity)
        else:
            if msg.capacity != worker.capacity:  # workers re-announce periodically: log changes only
                self.log.info("broker.worker_capacity", worker=msg.worker_id, capacity=msg.capacity)
            worker.capacity, worker.last_seen = msg.capacity, time.monotonic()
        self._dispatch(worker.service)

    def _on_job(self, ident: bytes, env: protocol.Envelope, frames: list) -> None:
        service = env.service or DEFAULT_SERVICE.get(env.kind, "")
        if not service:
            self._send(ident, protocol.encode(
                Error(code="no_service", message=f"{env.kind.value} names no service; set the header field "
                      "'service'", ref_id=env.id), reply_to=env.id))
            return
        existing = self.jobs.get(env.id)
        if existing is not None:  # a client resubmitted (e.g. after reconnecting): keep one copy, new route
            existing.client = ident
            self.counters["resubmitted"] += 1
            return
        queue = self.queues[service]
        if len(queue) >= self.max_queue:
            self.counters["queue_full"] += 1
            self._send(ident, protocol.encode(Error(code="queue_full", message=(
                f"service {service!r} has {len(queue)} queued jobs (max_queue {self.max_queue}); retry later "
                "or add workers"), ref_id=env.id), reply_to=env.id))
            return
        self.jobs[env.id] = JobState(env.id, ident, service, frames)
        queue.append(env.id)
        self.counters["accepted"] += 1
        self._dispatch(service)

    def _on_reply(self, ident: bytes, env: protocol.Envelope, frames: list) -> None:
        worker = self.workers[ident]
        worker.last_seen = time.monotonic()  # any reply is a sign of life (heartbeats may sit in a backlog)
        job = self.jobs.get(env.reply_to)
        if job is None or job.worker != ident:
            self.counters["duplicate_replies"] += 1
            self.log.info("broker.duplicate_reply", job=env.reply_to, worker=worker.worker_id)
            return
        worker.in_flight.discard(job.id)
        del self.jobs[job.id]
        self.counters["answered"] += 1
        self._send(job.client, frames)
        self._dispatch(worker.service)

    # ------------------------------------------------------------ dispatch and liveness
    def _dispatch(self, service: str) -> None:
        queue = self.queues.get(service)
        candidates = self.by_service.get(service)
        while queue and candidates:
            best = None
            for w in candidates.values():
                if w.free > 0 and (best is None or w.free > best.free):
                    best = w
            if best is None:
                return
            job = self.jobs.get(queue.popleft())
            if job is None:
                continue
            job.worker, job.attempts = best.ident, job.attempts + 1
            best.in_flight.add(job.id)
            self._send(best.ident, job.frames)

    def _drop_worker(self, ident: bytes, reason: str) -> None:
        worker = self.workers.pop(ident, None)
        if worker is None:
            return
        self.by_service[worker.service].pop(ident, None)
        requeued = 0
        for job_id in sorted(worker.in_flight, reverse=True):
            job = self.jobs.get(job_id)
            if job is not None:
                job.worker = None
                self.queues[job.service].appendleft(job_id)
                requeued += 1
        self.counters["workers_lost"] += 1 if not reason.startswith("disconnect") else 0
        self.log.warning("broker.worker_removed", worker=worker.worker_id, reason=reason, requeued=requeued)
        self._dispatch(worker.service)

    def tick(self, now: float) -> None:
        if now < self._next_check:
            return
        self._next_check = now + self.heartbeat_s
        deadline = now - self.heartbeat_s * self.liveness
        for ident in [i for i, w in self.workers.items() if w.last_seen < deadline]:
            self._drop_worker(ident, f"no heartbeat for {self.heartbeat_s * self.liveness:.1f}s")

    def _send(self, ident: bytes, frames: list) -> None:
        try:
            self.sock.send(ident, _SNDMORE)
            for frame in frames[:-1]:
                self.sock.send(frame, _SNDMORE, copy=False)
            self.sock.send(frames[-1], 0, copy=False)
        except zmq.ZMQError as exc:  # peer gone; the client will resubmit
            self.counters["send_errors"] += 1
            self.log.info("broker.send_failed", peer=ident.hex(), error=str(exc))

    def stats(self) -> dict:
        return {
            "workers": {w.worker_id: {"service": w.service, "capacity": w.capacity, "in_flight": len(w.in_flight)}
                        for w in self.workers.values()},
            "queued": {s: len(q) for s, q in self.queues.items()},
            "in_flight": sum(1 for j in self.jobs.values() if j.worker is not None),
            "counters": dict(self.counters),
        }

    def close(self) -> None:
        self.sock.close(0)
