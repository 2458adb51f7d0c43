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
- a reply is checked against its job (kind, lengths, finite numbers; reply_problem); a reply that fails
  to decode or makes no sense frees the worker's slot and reaches the client as Error(bad_reply);
- a job holds a lease while assigned (brokers.job_deadline_s, per service: dispatch.Leases): one not
  answered in time is taken back (the worker's slot freed, event broker.job_overdue) and requeued at the front
  for another worker, or after brokers.job_max_attempts assignments answered Error(job_failed); so a worker
  that never answers, or answers with a wrong reply_to, cannot wedge a client;
- a reward_job goes only to a worker whose READY `tasks` include its task (or that lists none); one no
  registered worker of its service can serve is answered Error(no_service) at once;
- a queue holds at most `max_queue` jobs, and at most `max_services` services exist at once (queued jobs or
  registered workers); beyond either the client gets an Error at once (queue_full / no_service);
- frames over max_frame_bytes + the header limit are dropped by ZeroMQ (ZMQ_MAXMSGSIZE: the connection is
  closed) before they are read whole; smaller bad ones are answered with Error naming the problem, logged
  at most once per peer and reason every 10 s (with the count); the broker keeps serving;
- a generate_request with a `session` goes to the worker that served that session last while it lives and
  has credit; if that worker is full the job waits for it at most `sticky_wait_s` (then any worker), and if
  it died, any worker (brokers/sticky.py: the LRU-bounded session map and the parked jobs);
- with CURVE keys, a peer may only say what its role owns (security.refusal): only worker roles register,
  only for their own services and up to `max_capacity`; only the controller (agent, launcher) submits jobs;
  only the rollout role sends generate_partial;
- a generate_partial (tokens of a streamed request, docs/protocol.md) is forwarded to the job's client only from
  the worker the job is assigned to and only for a generate_request; it never ends the job nor frees a slot
  (the generate_result does); anything else is dropped and counted (dropped_partials).
  Anything else is answered with Error(forbidden) and logged, rate-limited.
Who waits on whom: nobody waits on the broker except through credits; the broker waits on nothing.

Which worker gets which job (least loaded, credits, tasks, sticky sessions, requeue at the front) is decided
by the pure dispatch policy in brokers/dispatch.py, over the tables in `self.pool`; this class is the socket
shell around it: it decodes, checks, sends what the policy assigns (`_deliver`) and keeps liveness.
brokers/stub.py runs the same policy in process, without sockets, for tests.
"""
from __future__ import annotations

import math
import os
import time
from typing import Any

import numpy as np
import zmq

from areal_mq import protocol
from areal_mq.errors import ProtocolError
from areal_mq.messages import Error, Heartbeat, Kind, Message, Stats
from areal_mq.security import Keyring, RateLimited, peer_role, refusal

from . import dispatch
from .dispatch import Assignment, JobState, Leases, Pool, WorkerState
from .sticky import StickySessions

DEFAULT_SERVICE = {Kind.GENERATE_REQUEST: "generate", Kind.REWARD_JOB: "reward", Kind.EPISODE_JOB: "agent"}
REPLY_KINDS = {Kind.GENERATE_RESULT, Kind.REWARD_RESULT, Kind.EPISODE_RESULT, Kind.ERROR}
EXPECTED_REPLY = {Kind.GENERATE_REQUEST: Kind.GENERATE_RESULT, Kind.REWARD_JOB: Kind.REWARD_RESULT,
                  Kind.EPISODE_JOB: Kind.EPISODE_RESULT}
RCVHWM = 1000  # messages buffered per peer before ZeroMQ stops reading its connection (the peer queues)
# Plain-int socket flags: pyzmq's flag enums cost an Enum operation per frame on the hot path.
_NOBLOCK, _SNDMORE = int(zmq.NOBLOCK), int(zmq.SNDMORE)


def reply_problem(job: JobState, msg: Message) -> str | None:
    """What makes `msg` no answer to `job` (kind, lengths, non-finite numbers), or None. Cheap: no re-decode."""
    kind = msg.kind
    if kind == Kind.ERROR:
        return None
    expected = EXPECTED_REPLY.get(job.kind)
    if expected is not None and kind != expected:
        return f"a {kind.value} does not answer a {job.kind.value} (expected {expected.value} or error)"
    if kind == Kind.REWARD_RESULT:
        if expected is not None and len(msg.rewards) != job.n_items:
            return f"{len(msg.rewards)} rewards for {job.n_items} completion(s) (one per completion)"
        if not all(map(math.isfinite, msg.rewards)):
            return f"rewards must be finite numbers, got {[r for r in msg.rewards if not math.isfinite(r)][:3]}"
    elif kind == Kind.GENERATE_RESULT and not math.isfinite(msg.logprobs.sum(dtype=np.float64)):
        return "logprobs must be finite numbers"  # a float64 sum of float32 values is finite iff they all are
    elif kind == Kind.EPISODE_RESULT and not (math.isfinite(msg.seq.reward) and
                                               math.isfinite(msg.seq.logprobs.sum(dtype=np.float64))):
        return "an episode's reward and logprobs must be finite numbers"
    return None


def _removal_counter(reason: str) -> str:
    """The stats counter a removed registration counts in (docs/protocol.md §5.3): `workers_disconnected`
    (it said DISCONNECT), `workers_replaced` (its worker_id registered again from a new connection) or
    `workers_lost` (gone unannounced: missed heartbeats, or its connection closed)."""
    if reason.startswith("disconnect"):
        return "workers_disconnected"
    return "workers_replaced" if reason.startswith("replaced") else "workers_lost"


class JobBroker:
    """Owns one ROUTER socket. Driven by a BrokerHost poll loop: `handle()` on input, `tick()` on time."""

    def __init__(self, ctx: zmq.Context, address: str, *, heartbeat_s: float, liveness: int, max_queue: int,
                 max_frame_bytes: int, log: Any, keys: Keyring | None = None, max_capacity: int = 4096,
                 max_services: int = 64, max_sessions: int = 100_000, sticky_wait_s: float = 1.0,
                 leases: Leases | None = None):
        self.sock = ctx.socket(zmq.ROUTER)
        self.secure = keys is not None and keys.secure
        if keys is not None:
            keys.server(self.sock, address)
        self.max_capacity, self.max_services = max_capacity, max_services
        # answered in every heartbeat: a peer that sees it change knows this broker restarted and forgot its jobs
        self.boot_id = f"broker-{os.urandom(4).hex()}"
        self.refusals = RateLimited(log)  # forbidden and bad-input warnings: one line per peer+reason per 10 s
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
        self.sock.setsockopt(zmq.SNDHWM, 0)  # a ROUTER at its HWM drops what it sends: answers would be lost
        self.sock.setsockopt(zmq.RCVHWM, RCVHWM)
        # Larger frames are dropped by ZeroMQ as they arrive (connection closed), never buffered whole.
        self.sock.setsockopt(zmq.MAXMSGSIZE, max_frame_bytes + protocol.MAX_HEADER_BYTES)
        self.sock.bind(address)
        self.heartbeat_s, self.liveness, self.max_queue = heartbeat_s, liveness, max_queue
        self.max_frame_bytes = max_frame_bytes
        self.log = log
        # the dispatch policy's tables (brokers/dispatch.py decides over them); the names below are the same objects
        self.pool = pool = Pool(StickySessions(max_sessions, sticky_wait_s), leases=leases or Leases())
        self.workers, self.by_service, self.restricted = pool.workers, pool.by_service, pool.restricted
        self.queues, self.jobs, self.counters, self.sticky = pool.queues, pool.jobs, pool.counters, pool.sticky
        self._next_check = self._next_lease_check = 0.0
        self._worker_fds: dict[int, bytes] = {}  # a registered worker's connection (ZMQ_SRCFD) -> its ident
        self.poll_closed: Any = None  # handles the socket monitor's pending events (brokers/main.py sets it)
        self.metrics: Any = None  # telemetry.prometheus.BrokerMetrics when metrics.prometheus is on

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
            try:
                self._on_message(raw)
            except Exception as exc:  # noqa: BLE001 - a bug must not end the poll loop: answer `internal`, go on
                self._internal_error(raw, exc)

    def _internal_error(self, raw: list, exc: Exception) -> None:
        """A message made the broker fail (a bug, found by fuzzing or not): logged, answered Error(internal)."""
        self.counters["internal_errors"] += 1
        self.refusals.error("broker.internal_error", key=f"internal:{type(exc).__name__}",
                            error=f"{type(exc).__name__}: {str(exc)[:300]}", where=protocol.where(exc))
        if len(raw) >= 2:
            ident = raw[0].bytes if hasattr(raw[0], "bytes") else bytes(raw[0])
            self._send(ident, protocol.encode(Error(code="internal", message=f"the broker failed on this message "
                                                    f"({type(exc).__name__}); it was dropped")))

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
            if ident in self.workers:  # a worker's refused reply must still reach its client
                self._on_refused_reply(ident, frames, exc)
            self._refuse(ident, exc)
            return
        self._dispatch_kind(ident, env, frames, peer_role(raw[0], self.secure), raw[0])

    def _dispatch_kind(self, ident: bytes, env: protocol.Envelope, frames: list, role: str | None = None,
                       frame0: Any = None) -> None:
        kind = env.kind
        why = self._not_allowed(env, role)
        if why:
            self._forbid(ident, env, role, why)
        elif kind == Kind.READY:
            self._on_ready(ident, env, frame0)
        elif kind == Kind.DISCONNECT:
            self._drop_worker(ident, f"disconnect: {env.msg.reason}")
        elif kind in REPLY_KINDS and env.reply_to and ident in self.workers:
            self._on_reply(ident, env, frames)
        elif kind == Kind.GENERATE_PARTIAL:
            self._on_partial(ident, env, frames)
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
        if kind == Kind.GENERATE_PARTIAL:
            return refusal(role, "stream")
        if kind in (Kind.DISCONNECT, Kind.STATS_REQUEST) or kind in REPLY_KINDS:
            return None  # a disconnect or reply only concerns the sender's own registration and jobs
        if kind == Kind.GENERATE_REQUEST and env.msg.pin_version is not None:  # a periodic evaluation's: controller only
            return refusal(role, "submit") or refusal(role, "submit:pinned")
        return refusal(role, "submit")

    def _forbid(self, ident: bytes, env: protocol.Envelope, role: str | None, why: str) -> None:
        self.counters["forbidden"] += 1
        self.refusals.warning("broker.forbidden", key=f"{role}:{env.kind.value}", role=role,
                              kind=env.kind.value, error=why)
        self._send(ident, protocol.encode(Error(code="forbidden", message=why, ref_id=env.id), reply_to=env.id))

    def _refuse(self, ident: bytes, exc: ProtocolError) -> None:
        self.counters["refused"] += 1
        self.refusals.warning("broker.bad_message", key=f"{ident.hex()}:{exc.code}", code=exc.code,
                              error=str(exc)[:500], peer=ident.hex())
        self._send(ident, protocol.error_reply(exc))

    def _on_refused_reply(self, ident: bytes, frames: list, exc: ProtocolError) -> None:
        """A registered worker's message failed to decode; if it answers one of its jobs, fail that job."""
        job = self.jobs.get(protocol.peek_reply_to(frames))
        if job is not None and job.worker == ident:
            worker = self.workers[ident]
            worker.last_seen = time.monotonic()
            self._fail_job(worker, job, f"the reply of worker {worker.worker_id!r} was refused: [{exc.code}] {exc}")

    def _on_heartbeat(self, ident: bytes) -> None:
        worker = self.workers.get(ident)
        if worker is not None:
            worker.last_seen = time.monotonic()
        self._send(ident, protocol.encode(Heartbeat(peer_id=self.boot_id)))

    def _error(self, ident: bytes, ref_id: str, code: str, message: str) -> None:
        self._send(ident, protocol.encode(Error(code=code, message=message, ref_id=ref_id), reply_to=ref_id))

    def _remember_fd(self, frame: Any, ident: bytes) -> None:
        try:
            self._worker_fds[frame.get(zmq.SRCFD)] = ident
        except (AttributeError, zmq.ZMQError):  # a plain bytes frame (tests), or no fd (inproc)
            pass

    def connection_closed(self, fd: int) -> None:
        """The socket monitor saw connection `fd` close. If a registered worker used it, its registration ends
        now (its jobs requeued): ZeroMQ gives a reconnecting DEALER a new identity, so nothing can reach the old
        one again, and the worker's READY on its new connection must not be refused as a live duplicate."""
        ident = self._worker_fds.pop(fd, None)
        worker = self.workers.get(ident) if ident is not None else None
        if worker is None:
            return
        self.refusals.warning(
            "broker.worker_connection_closed", key=f"{worker.worker_id}:closed", worker=worker.worker_id,
            in_flight=len(worker.in_flight), hint="its process died or closed its socket without DISCONNECT, or it "
            f"sent a frame over brokers.max_frame_mb + 4 MiB ({self.max_frame_bytes + protocol.MAX_HEADER_BYTES} "
            "bytes; ZeroMQ closes such a connection unread and does not say which); its registration ends now and "
            "its jobs are requeued: it may send READY again at once")
        self._drop_worker(ident, "connection closed")

    def _drain_closed(self) -> None:
        """Handle the socket monitor's pending closed-connection events now (`poll_closed`, set by the host),
        so a READY from a reconnected worker is never judged against a registration whose connection is gone
        but whose close event still waits behind it in the poll loop (and a reused fd is never mistaken)."""
        if self.poll_closed is not None:
            self.poll_closed()

    def _on_ready(self, ident: bytes, env: protocol.Envelope, frame0: Any = None) -> None:
        msg = env.msg
        tasks = frozenset(msg.tasks)
        worker = self.workers.get(ident)
        if worker is None:
            self._drain_closed()
            why = (dispatch.service_refusal(self.pool, msg.service, self.max_services)
                   or self._worker_id_taken(msg.worker_id))
            if why:
                self._error(ident, env.id, "bad_request" if why.startswith("worker_id") else "no_service", why)
                return
            worker = WorkerState(ident, msg.worker_id, msg.service, msg.capacity, time.monotonic(), tasks)
            dispatch.add_worker(self.pool, worker)
            self._remember_fd(frame0, ident)
            self.log.info("broker.worker_ready", worker=msg.worker_id, service=msg.service, capacity=msg.capacity,
                          tasks=sorted(tasks)[:20])
        elif msg.service != worker.service:
            self._error(ident, env.id, "bad_request", (
                f"this connection serves {worker.service!r}; a READY cannot change it to {msg.service[:64]!r}: "
                "open a new socket for another service"))
            return
        else:
            if msg.capacity != worker.capacity:  # workers re-announce periodically: log changes only
                self.log.info("broker.worker_capacity", worker=msg.worker_id, capacity=msg.capacity)
            dispatch.update_worker(self.pool, worker, msg.capacity, tasks, time.monotonic())
        self._deliver(dispatch.freed(self.pool, worker, time.monotonic()))

    def _worker_id_taken(self, worker_id: str) -> str | None:
        """Why a new connection may not register as `worker_id` (None: it may). A registration of that id
        heard from within 2 heartbeats, whose connection is open, is another live worker: refused (and logged).
        One silent longer is taken to be the same worker reconnecting on a new socket: replaced (its jobs
        requeued) so the new one takes its place. A closed connection's registration is already gone."""
        same = next((w for w in self.workers.values() if w.worker_id == worker_id), None)
        if same is None:
            return None
        if time.monotonic() - same.last_seen > 2 * self.heartbeat_s:
            self._drop_worker(same.ident, "replaced: its worker_id registered again from a new connection")
            return None
        self.counters["duplicate_worker_ids"] += 1
        self.refusals.warning("broker.duplicate_worker_id", key=f"{worker_id[:128]}:duplicate_id",
                              worker=worker_id[:128], service=same.service,
                              hint="two live connections say READY with one worker_id: give every worker a unique "
                                   "worker_id (a worker reconnecting after its connection closed is not refused)")
        return (f"worker_id {worker_id[:128]!r} is already registered by another live connection (service "
                f"{same.service!r}); give every worker a unique worker_id. The same worker reconnecting is "
                f"accepted once its old connection has closed or been silent for {2 * self.heartbeat_s:g}s: "
                "send READY again then")

    def _on_job(self, ident: bytes, env: protocol.Envelope, frames: list) -> None:
        service = env.service or DEFAULT_SERVICE.get(env.kind, "")
        if not service:
            self._error(ident, env.id, "no_service",
                        f"{env.kind.value} names no service; set the header field 'service'")
            return
        existing = self.jobs.get(env.id)
        if existing is not None:  # a client resubmitted (e.g. after reconnecting): keep one copy, new route
            existing.client = ident
            self.counters["resubmitted"] += 1
            return
        is_reward = env.kind == Kind.REWARD_JOB
        task = env.msg.task if is_reward else None
        why = (dispatch.service_refusal(self.pool, service, self.max_services)
               or (dispatch.task_refusal(self.pool, service, task) if task is not None else None))
        if why:
            self._error(ident, env.id, "no_service", why)
            return
        job = JobState(env.id, ident, service, frames, env.kind, task, len(env.msg.completions) if is_reward else 0,
                       session=env.msg.session if env.kind == Kind.GENERATE_REQUEST else "")
        sent = dispatch.enqueue(self.pool, job, self.max_queue, time.monotonic())
        if sent is None:
            self._error(ident, env.id, "queue_full", f"service {service!r} has {len(self.queues[service])} queued "
                        f"jobs (max_queue {self.max_queue}); retry later or add workers")
            return
        self._deliver(sent)

    def _on_reply(self, ident: bytes, env: protocol.Envelope, frames: list) -> None:
        worker = self.workers[ident]
        worker.last_seen = now = time.monotonic()  # any reply is a sign of life (heartbeats may sit in a backlog)
        job = self.jobs.get(env.reply_to)
        if job is None or job.worker != ident:
            self.counters["duplicate_replies"] += 1
            # normal after a requeue (a slow worker answers a job another already did): one line per worker per 10 s
            self.refusals.info("broker.duplicate_reply", key=f"{worker.worker_id}:duplicate", job=env.reply_to,
                               worker=worker.worker_id)
            return
        why = reply_problem(job, env.msg)
        if why:
            why = f"worker {worker.worker_id!r} answered job {job.id} with a bad reply: {why}"
            self._error(ident, env.id, "bad_reply", why)  # tell the worker too: it is its bug
            self._fail_job(worker, job, why)
            return
        dispatch.finish(self.pool, worker, job)
        self.counters["answered"] += 1
        if self.metrics is not None:
            self.metrics.answered(job, now)
        self._send(job.client, frames)
        self._deliver(dispatch.freed(self.pool, worker, now))

    def _on_partial(self, ident: bytes, env: protocol.Envelope, frames: list) -> None:
        """Forward a streamed request's partial tokens to its client; the job stays assigned (a view, not an answer)."""
        job = self.jobs.get(env.reply_to)
        worker = self.workers.get(ident)
        if worker is None or job is None or job.worker != ident or job.kind != Kind.GENERATE_REQUEST:
            self.counters["dropped_partials"] += 1  # late (requeued, answered) or not this worker's: never forwarded
            return
        worker.last_seen = time.monotonic()
        self.counters["partials"] += 1
        self._send(job.client, frames)

    def _fail_job(self, worker: WorkerState, job: JobState, why: str) -> None:
        """Answer `job` to its client with Error(bad_reply) instead of the worker's reply; free the slot."""
        dispatch.finish(self.pool, worker, job)
        self.counters["bad_replies"] += 1
        self.refusals.warning("broker.bad_reply", key=f"{worker.ident.hex()}:bad_reply", worker=worker.worker_id,
                              job=job.id, error=why[:500])
        self._error(job.client, job.id, "bad_reply", why)
        self._deliver(dispatch.freed(self.pool, worker, time.monotonic()))

    # ------------------------------------------------------------ dispatch and liveness
    def _deliver(self, assignments: list[Assignment]) -> None:
        """Send each job the dispatch policy (brokers/dispatch.py) gave a worker to that worker."""
        if self.metrics is not None and assignments:
            self.metrics.delivered(assignments, time.monotonic())
        for job, worker in assignments:
            self._send(worker.ident, job.frames)

    def _drop_worker(self, ident: bytes, reason: str) -> None:
        dropped = dispatch.remove_worker(self.pool, ident)  # its in-flight and parked jobs: front of the queue
        if dropped is None:
            return
        worker, requeued = dropped
        self._worker_fds = {fd: i for fd, i in self._worker_fds.items() if i != ident}
        self.counters[_removal_counter(reason)] += 1
        self.log.warning("broker.worker_removed", worker=worker.worker_id, reason=reason, requeued=requeued)
        self._deliver(dispatch.dispatch(self.pool, worker.service, time.monotonic()))

    def tick(self, now: float) -> None:
        if self.sticky.due(now):  # parked jobs that waited sticky_wait_s: front of their queue, any worker
            self._deliver(dispatch.expire_parked(self.pool, now))
        if now >= self._next_lease_check:  # a lease is seconds to minutes: a check per 0.25 s is precise enough
            self._next_lease_check = now + 0.25
            self._take_back_overdue(now)
        if now < self._next_check:
            return
        self._next_check = now + self.heartbeat_s
        deadline = now - self.heartbeat_s * self.liveness
        for ident in [i for i, w in self.workers.items() if w.last_seen < deadline]:
            self._drop_worker(ident, f"no heartbeat for {self.heartbeat_s * self.liveness:.1f}s")

    def _take_back_overdue(self, now: float) -> None:
        """Jobs held past their lease: requeued for another worker, or failed to their client."""
        sent, late = dispatch.overdue(self.pool, now)
        for one in late:
            job, worker, failed = one
            action = "failed" if failed else "requeued"  # one rate-limit key each: a failure is never hidden
            self.refusals.warning("broker.job_overdue", key=f"{worker.worker_id}:overdue:{action}", job=job.id,
                                  worker=worker.worker_id, service=job.service, lease_s=self.pool.leases.of(job.service),
                                  attempts=job.attempts, action=action)
            if failed:
                self._error(job.client, job.id, "job_failed", dispatch.overdue_failure(self.pool, one))
        self._deliver(sent)

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
        return dispatch.stats(self.pool)

    def close(self) -> None:
        self.sock.close(0)
