"""StubBroker: the job broker in one process, without sockets, for tests of clients and workers.

What: clients submit jobs for a service, workers register with a capacity and take the jobs given to them,
and their replies go back to the client that asked, decided by the same dispatch policy as the real job
broker (brokers/dispatch.py: least loaded, credits, tasks, sticky sessions, requeue at the front) and
checked the same way (job_broker.reply_problem). Every message goes through protocol.encode/decode as on
the wire, so a message that would be refused there is refused here (answered with Error, as the broker
does). Modelled on dramatiq's StubBroker: part of the test kit users get, as areal_mq.brokers.stub.

Why: a workflow, reward or controller author tests their code against the broker's real routing rules in
milliseconds, with no ports, processes or sleeps; a worker "dies" with one call and its jobs are requeued.

How to use it (thread-safe: workers may run in threads; `take`, `poll`, `wait` and `join` block up to a
timeout):

    from areal_mq.brokers.stub import StubBroker
    from areal_mq.messages import RewardJob, RewardResult

    broker = StubBroker()
    worker = broker.worker("reward", capacity=2, tasks=["math"])
    client = broker.client()
    job_id = client.submit(RewardJob(task="math", prompt="2+3?", completions=["5"], reference="5"))
    got_id, job = worker.take(timeout=1.0)        # (job id, RewardJob), or None
    worker.reply(got_id, RewardResult(rewards=[1.0]))
    assert client.wait(job_id, timeout=1.0).rewards == [1.0]   # JobFailed on Error, like JobClient

`client` mirrors areal_mq.client.JobClient (submit, poll, wait, forget, pending); `worker.die()` drops a
worker as a missed heartbeat would, `worker.set_capacity(0)` pauses it (READY(0)). Sticky waits expire on
`clock` (default time.monotonic; pass your own to step time), checked on every call and by `tick()`; so do
job leases, as the job broker's (`leases=Leases(default_s, per_service, max_attempts)`, brokers/dispatch.py;
none by default): a job held past its lease goes to the front of its queue for another worker, and after
`max_attempts` assignments its client gets Error(job_failed); the late worker's reply is dropped.
"""
from __future__ import annotations

import collections
import threading
import time
from typing import Callable

from areal_mq import protocol
from areal_mq.errors import BrokerUnavailable, JobFailed, ProtocolError
from areal_mq.messages import Error, Kind, Message

from . import dispatch
from .dispatch import Assignment, JobState, Leases, Pool, WorkerState
from .job_broker import DEFAULT_SERVICE, REPLY_KINDS, reply_problem
from .sticky import StickySessions

NOT_JOBS = REPLY_KINDS | {Kind.READY, Kind.HEARTBEAT, Kind.DISCONNECT, Kind.STATS_REQUEST,
                          Kind.GENERATE_PARTIAL}
_SLICE_S = 0.05  # a blocked take/poll wakes this often to expire sticky waits and leases


def _wire(msg: Message, **envelope) -> list:
    """`msg` as the frames a socket would carry (arrays copied: the receiver must not share the sender's)."""
    if not isinstance(msg, Message):
        raise TypeError(f"expected an areal_mq.messages message, got {type(msg).__name__}")
    frames = protocol.encode(msg, **envelope)
    return [frames[0], *(a.tobytes() for a in frames[1:])]


class StubBroker:
    """The job broker's routing in process: `client()`s submit, `worker()`s take and reply."""

    def __init__(self, *, max_queue: int = 10_000, max_services: int = 64, max_capacity: int = 4096,
                 max_sessions: int = 100_000, sticky_wait_s: float = 1.0, clock: Callable[[], float] = time.monotonic,
                 leases: Leases | None = None):
        self.max_queue, self.max_services, self.max_capacity = max_queue, max_services, max_capacity
        self.clock = clock
        self.pool = Pool(StickySessions(max_sessions, sticky_wait_s), leases=leases or Leases())
        self.cond = threading.Condition()
        self._inbox: dict[bytes, collections.deque[str]] = {}  # worker ident -> job ids given, not yet taken
        self._clients: dict[bytes, StubClient] = {}
        self._n = 0

    def client(self, name: str = "") -> StubClient:
        with self.cond:
            self._n += 1
            client = StubClient(self, f"client-{self._n}{'-' + name if name else ''}".encode())
            self._clients[client.ident] = client
            return client

    def worker(self, service: str, capacity: int = 1, *, worker_id: str = "", tasks=()) -> StubWorker:
        """Register a worker (READY): it gets up to `capacity` jobs at once of `service` (and of `tasks`)."""
        if not service or not isinstance(service, str):
            raise ValueError(f"a worker needs a service name, got {service!r}")
        if isinstance(tasks, str):
            raise ValueError(f"tasks is a list of task names, got the string {tasks!r}")
        self._check_capacity(capacity)
        with self.cond:
            why = dispatch.service_refusal(self.pool, service, self.max_services)
            if why:
                raise ValueError(why)
            self._n += 1
            worker_id = worker_id or f"stub-{service}-{self._n}"
            state = WorkerState(f"worker-{self._n}".encode(), worker_id, service, capacity, self.clock(),
                                frozenset(tasks))
            dispatch.add_worker(self.pool, state)
            self._inbox[state.ident] = collections.deque()
            self._deliver(dispatch.freed(self.pool, state, self.clock()))
            return StubWorker(self, state)

    def _check_capacity(self, capacity: int) -> None:
        if not isinstance(capacity, int) or not 0 <= capacity <= self.max_capacity:
            raise ValueError(f"capacity must be an int in [0, {self.max_capacity}] (0: paused), got {capacity!r}")

    def tick(self) -> None:
        """Send the parked jobs whose sticky wait ran out to any worker, and take back the jobs held past their
        lease (every call does this too)."""
        with self.cond:
            self._expire()

    def join(self, timeout: float = 10.0) -> None:
        """Block until every submitted job is answered; TimeoutError naming what is left otherwise."""
        deadline = time.monotonic() + timeout
        with self.cond:
            while self.pool.jobs:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"{len(self.pool.jobs)} job(s) still unanswered after {timeout}s: "
                                       f"{self.stats()['queued']} queued; are workers taking them?")
                self.cond.wait(min(left, _SLICE_S))
                self._expire()

    def stats(self) -> dict:
        """The same figures as the job broker's Stats answer."""
        with self.cond:
            return dispatch.stats(self.pool)

    # ------------------------------------------------------------ under the lock
    def _expire(self) -> None:
        now = self.clock()
        if self.pool.sticky.due(now):
            self._deliver(dispatch.expire_parked(self.pool, now))
        sent, late = dispatch.overdue(self.pool, now)  # held past its lease: requeued, or failed to its client
        for one in late:
            if one.failed:
                self._error(one.job.client, one.job.id, "job_failed", dispatch.overdue_failure(self.pool, one))
        self._deliver(sent)

    def _deliver(self, assignments: list[Assignment]) -> None:
        for job, worker in assignments:
            self._inbox[worker.ident].append(job.id)
        if assignments:
            self.cond.notify_all()

    def _answer(self, client: bytes, job_id: str, frames: list) -> None:
        target = self._clients.get(client)
        if target is not None and job_id in target.pending:
            target.answers.append((job_id, protocol.decode(frames).msg))
            self.cond.notify_all()

    def _error(self, client: bytes, job_id: str, code: str, message: str) -> None:
        self._answer(client, job_id, _wire(Error(code=code, message=message, ref_id=job_id), reply_to=job_id))

    def _submit(self, client: bytes, job_id: str, frames: list, service: str) -> None:
        self._expire()
        try:
            msg = protocol.decode(frames).msg
        except ProtocolError as exc:  # the broker answers a message it cannot read with an Error
            self._error(client, job_id, exc.code, str(exc))
            return
        if msg.kind in NOT_JOBS:
            self._error(client, job_id, "bad_request", f"a {msg.kind.value} is not a job")
            return
        service = service or DEFAULT_SERVICE.get(msg.kind, "")
        existing = self.pool.jobs.get(job_id)
        if existing is not None:  # resubmitted: one copy, answered to the latest sender
            existing.client = client
            return
        task = msg.task if msg.kind == Kind.REWARD_JOB else None
        why = (f"{msg.kind.value} names no service" if not service else
               dispatch.service_refusal(self.pool, service, self.max_services)
               or (dispatch.task_refusal(self.pool, service, task) if task is not None else None))
        if why:
            self._error(client, job_id, "no_service", why)
            return
        job = JobState(job_id, client, service, frames, msg.kind, task,
                       len(msg.completions) if msg.kind == Kind.REWARD_JOB else 0,
                       session=msg.session if msg.kind == Kind.GENERATE_REQUEST else "")
        sent = dispatch.enqueue(self.pool, job, self.max_queue, self.clock())
        if sent is None:
            self._error(client, job_id, "queue_full", f"service {service!r} has {len(self.pool.queues[service])} "
                        f"queued jobs (max_queue {self.max_queue})")
            return
        self._deliver(sent)


class StubClient:
    """Submits jobs and collects their answers, like areal_mq.client.JobClient (without a socket)."""

    def __init__(self, broker: StubBroker, ident: bytes):
        self.broker, self.ident = broker, ident
        self.pending: set[str] = set()
        self.answers: collections.deque[tuple[str, Message]] = collections.deque()

    def submit(self, msg: Message, service: str = "", job_id: str | None = None) -> str:
        job_id = job_id or protocol.new_id()
        frames = _wire(msg, id=job_id, service=service)
        with self.broker.cond:
            self.pending.add(job_id)
            self.broker._submit(self.ident, job_id, frames, service)
        return job_id

    def poll(self, timeout: float = 0.0) -> list[tuple[str, Message]]:
        """Answers that arrived within `timeout` seconds: (job id, result message or Error)."""
        deadline = time.monotonic() + timeout
        with self.broker.cond:
            self.broker._expire()
            while not self.answers and time.monotonic() < deadline:
                self.broker.cond.wait(min(deadline - time.monotonic(), _SLICE_S))
                self.broker._expire()
            out = [(job_id, msg) for job_id, msg in self.answers if job_id in self.pending]
            self.answers.clear()
            self.pending.difference_update(job_id for job_id, _ in out)
            return out

    def wait(self, job_id: str, timeout: float) -> Message:
        """Block until `job_id` is answered; JobFailed on Error, BrokerUnavailable on timeout (as JobClient)."""
        deadline = time.monotonic() + timeout
        with self.broker.cond:
            while True:
                for i, (rid, msg) in enumerate(self.answers):
                    if rid == job_id:
                        del self.answers[i]
                        self.pending.discard(job_id)
                        if isinstance(msg, Error):
                            raise JobFailed(f"job {job_id} failed: [{msg.code}] {msg.message}")
                        return msg
                left = deadline - time.monotonic()
                if left <= 0:
                    raise BrokerUnavailable(f"job {job_id} not answered within {timeout:.1f}s (stub broker: is a "
                                            "worker of its service taking and answering jobs?)")
                self.broker.cond.wait(min(left, _SLICE_S))
                self.broker._expire()

    def forget(self, job_id: str) -> bool:
        """Stop waiting for `job_id`: its answer, if one still comes, is dropped. False if it was not pending."""
        with self.broker.cond:
            known = job_id in self.pending
            self.pending.discard(job_id)
            return known


class StubWorker:
    """A registered worker: `take()` the jobs the broker gives it, `reply()` to each."""

    def __init__(self, broker: StubBroker, state: WorkerState):
        self.broker, self.state = broker, state
        self.errors: list[Error] = []  # what the broker told this worker (a bad reply: its bug)

    @property
    def alive(self) -> bool:
        return self.broker.pool.workers.get(self.state.ident) is self.state

    def take(self, timeout: float = 0.0) -> tuple[str, Message] | None:
        """The next job given to this worker, (job id, message), waiting up to `timeout`; None if none came."""
        broker = self.broker
        deadline = time.monotonic() + timeout
        with broker.cond:
            broker._expire()
            inbox = broker._inbox.get(self.state.ident)
            while inbox is not None and not inbox and time.monotonic() < deadline:
                broker.cond.wait(min(deadline - time.monotonic(), _SLICE_S))
                broker._expire()
                inbox = broker._inbox.get(self.state.ident)
            while inbox:
                job = broker.pool.jobs.get(inbox.popleft())
                if job is not None and job.worker == self.state.ident:
                    return job.id, protocol.decode(job.frames).msg
            return None

    def reply(self, job_id: str, msg: Message) -> bool:
        """Answer `job_id`. False when the answer is dropped: the job is not (or no longer) this worker's.
        A reply that does not answer the job (reply_problem) reaches the client as Error(bad_reply)."""
        frames = _wire(msg, reply_to=job_id)
        broker = self.broker
        with broker.cond:
            pool = broker.pool
            job = pool.jobs.get(job_id)
            if not self.alive or job is None or job.worker != self.state.ident:
                pool.counters["duplicate_replies" if self.alive else "orphan_replies"] += 1
                return False
            self.state.last_seen = now = broker.clock()
            why = reply_problem(job, protocol.decode(frames).msg)
            dispatch.finish(pool, self.state, job)
            if why:
                why = f"worker {self.state.worker_id!r} answered job {job_id} with a bad reply: {why}"
                pool.counters["bad_replies"] += 1
                self.errors.append(Error(code="bad_reply", message=why, ref_id=job_id))
                broker._error(job.client, job_id, "bad_reply", why)
            else:
                pool.counters["answered"] += 1
                broker._answer(job.client, job_id, frames)
            broker._deliver(dispatch.freed(pool, self.state, now))
            return True

    def set_capacity(self, capacity: int) -> None:
        """READY again with a new capacity (0: paused; the jobs parked for it go to others)."""
        self.broker._check_capacity(capacity)
        with self.broker.cond:
            if not self.alive:
                raise RuntimeError(f"worker {self.state.worker_id!r} left the broker; register a new one")
            now = self.broker.clock()
            dispatch.update_worker(self.broker.pool, self.state, capacity, self.state.tasks, now)
            self.broker._deliver(dispatch.freed(self.broker.pool, self.state, now))

    def disconnect(self) -> None:
        """Leave (DISCONNECT): jobs given to it and not answered go back to the front of their queue."""
        self._leave(lost=False)

    def die(self) -> None:
        """Vanish, as a worker whose heartbeats stopped: the same requeue, counted as workers_lost."""
        self._leave(lost=True)

    def _leave(self, lost: bool) -> None:
        broker = self.broker
        with broker.cond:
            if dispatch.remove_worker(broker.pool, self.state.ident) is None:
                return
            broker.pool.counters["workers_lost"] += lost
            broker._inbox.pop(self.state.ident, None)
            broker._deliver(dispatch.dispatch(broker.pool, self.state.service, broker.clock()))
