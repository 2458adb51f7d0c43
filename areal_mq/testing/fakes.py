"""The test doubles our tests pass in instead of sockets and processes: one definition of each (STYLE 14, 16).

What:
- `RecordingLog`   a structured logger (structlog's BoundLogger surface: debug/info/warning/error/exception,
                   `bind`) that keeps every record; `named(event)` gives the fields of each record of an event.
- `FakeRuntime`    the role-facing surface of areal_mq.actor.runtime.WorkerRuntime (next_job, next_signal,
                   ready, reply, partial, fail, stopping, log): jobs and signals the test scripted, replies recorded.
- `InMemoryJobs`   areal_mq.client.JobClient's surface (submit, poll, forget, close, pending) with no broker:
                   the test answers jobs itself with `answer(job_id, msg)`, or passes an `answerer`.
- `InMemoryStore`  the sample store's `put` as a list.
- `ManualClock`    a monotonic clock the test moves (`advance(dt)`), for code that takes a `clock=`.
The job broker's routing in one process, with its real dispatch policy, is `areal_mq.brokers.stub.StubBroker`
(it lives beside the broker it mirrors; the core package imports no broker): use it when the test is about
which worker gets which job; use `InMemoryJobs` when the test answers each job by hand.

Why: these were redeclared in many test files (nine loggers, three job clients, two runtimes), each a little
different; a workflow, reward or role author tests their code with the same doubles we use.

How:
    from areal_mq.testing import FakeRuntime, InMemoryJobs, InMemoryStore, RecordingLog

    log = RecordingLog()
    ctl = Controller(cfg, data, formatter, jobs := InMemoryJobs(), store := InMemoryStore(), log)
    ctl.step(timeout=0.0)
    for job_id, msg in list(jobs.pending.items()):
        jobs.answer(job_id, GenerateResult(...))   # delivered by the next poll()
    assert log.named("controller.group_failed") == []
"""
from __future__ import annotations

import threading
from functools import partialmethod
from typing import Any, Callable, Iterable

from areal_mq.messages import Error, Kind, Message

LEVELS = ("debug", "info", "warning", "error", "exception", "critical")


class RecordingLog:
    """A logger that keeps `records`: (level, event, fields), in order. Thread-safe (one list, one lock)."""

    def __init__(self, _records: list | None = None, _lock: threading.Lock | None = None, **bound: Any):
        self.records: list[tuple[str, str, dict]] = [] if _records is None else _records
        self._lock = _lock or threading.Lock()
        self._bound = bound

    def bind(self, **fields: Any) -> "RecordingLog":
        """A logger that adds `fields` to each record and keeps them in the same list (as structlog's bind)."""
        return RecordingLog(self.records, self._lock, **{**self._bound, **fields})

    def _add(self, level: str, event: str, **fields: Any) -> None:
        with self._lock:
            self.records.append((level, event, {**self._bound, **fields}))

    # log.debug(event, **fields) ... log.critical(...): one record each, at that level
    debug = partialmethod(_add, "debug")
    info = partialmethod(_add, "info")
    warning = partialmethod(_add, "warning")
    error = partialmethod(_add, "error")
    exception = partialmethod(_add, "exception")
    critical = partialmethod(_add, "critical")

    @property
    def events(self) -> list[tuple[str, dict]]:
        """(event, fields) of every record, any level."""
        with self._lock:
            return [(e, f) for _, e, f in self.records]

    def named(self, event: str) -> list[dict]:
        """The fields of each record of `event`, in order."""
        with self._lock:
            return [f for _, e, f in self.records if e == event]

    def at(self, level: str) -> list[tuple[str, dict]]:
        """(event, fields) of each record logged at `level` ("warning", ...)."""
        if level not in LEVELS:
            raise ValueError(f"unknown log level {level!r}; one of {', '.join(LEVELS)}")
        with self._lock:
            return [(e, f) for lv, e, f in self.records if lv == level]


class Signal:
    """What WorkerRuntime.next_signal returns, as far as a role reads it: the message in `.msg`."""

    def __init__(self, msg: Message, topic: str = ""):
        self.msg, self.topic = msg, topic

    def __repr__(self) -> str:
        return f"Signal({self.msg!r})"


class FakeRuntime:
    """WorkerRuntime's role-facing API with no sockets: the role takes the `jobs` and `signals` given (messages,
    wrapped as the runtime wraps them), its replies land in `replies` (job id -> message; `fail` replies an
    Error and logs `<role>.job_failed` as the real runtime does), each READY's capacity in `readies`.
    A job answered twice raises AssertionError: the runtime's contract is one answer per job."""

    keys = None  # no CURVE identity: roles that fetch weights use plaintext against test servers

    def __init__(self, service: str = "svc", worker_id: str = "fake-worker", capacity: int = 4,
                 jobs: Iterable[Any] = (), signals: Iterable[Message] = (), log: Any = None, role: str = ""):
        self.service, self.worker_id, self.capacity, self.role = service, worker_id, capacity, role or service
        self.tasks: list[str] = []
        self.log = log if log is not None else RecordingLog()
        self.jobs = list(jobs)
        self.signals = [Signal(m) for m in signals]
        self.readies: list[int] = []
        self.replies: dict[str, Message] = {}
        self.partials: dict[str, list[Message]] = {}  # job id -> GeneratePartials sent while it ran
        self.stopping = False
        self.stop_reason = ""

    def next_job(self, timeout: float = 0.0) -> Any:
        return self.jobs.pop(0) if self.jobs else None

    def next_signal(self, timeout: float = 0.0) -> Signal | None:
        return self.signals.pop(0) if self.signals else None

    def ready(self, capacity: int | None = None, tasks: Iterable[str] | None = None) -> None:
        if capacity is not None:
            self.capacity = capacity
        if tasks is not None:
            self.tasks = sorted(tasks)
        self.readies.append(self.capacity)

    def reply(self, job: Any, msg: Message) -> None:
        if job.id in self.replies:
            raise AssertionError(f"job {job.id} answered twice: {self.replies[job.id]!r}, then {msg!r}")
        self.replies[job.id] = msg

    def partial(self, job: Any, msg: Message) -> None:
        if job.id in self.replies:
            raise AssertionError(f"job {job.id} got a partial after its answer: {msg!r}")
        self.partials.setdefault(job.id, []).append(msg)

    def fail(self, job: Any, code: str, message: str) -> None:
        self.log.warning(f"{self.role}.job_failed", job=job.id, code=code, error=message)
        self.reply(job, Error(code=code, message=message, ref_id=job.id))

    def request_stop(self, reason: str) -> None:
        self.stopping, self.stop_reason = True, reason


class InMemoryLink:
    """JobClient.link's health, as its users read it: `silent_s(now)` (seconds since the broker last spoke) and
    `delay` (the reconnect backoff now). Set `silent` / `delay` to play a broker gone quiet."""

    broker_id = "in-memory"

    def __init__(self):
        self.silent, self.delay = 0.0, 0.0

    def silent_s(self, now: float) -> float:
        return self.silent


class InMemoryJobs:
    """JobClient with no broker. `pending` maps each unanswered job id to its message; `answer(job_id, msg)`
    queues an answer that the next `poll` delivers (and takes the job out of `pending`); an answer to a job no
    longer pending (forgotten, answered) is dropped, as JobClient drops it. `answerer(msg) -> reply | None`,
    if given, is asked at each poll for every pending job. `poll(timeout)` with nothing to deliver waits up to
    `timeout` for an `answer`, as JobClient blocks on its socket. Thread-safe.

    Records: `submitted` (messages, in order), `services` (job id -> service), `forgotten` (ids),
    `polled_pending` (the pending ids at each poll), `dropped` (answers that found no pending job), `closed`;
    `link` is an InMemoryLink."""

    address = "inproc://in-memory-jobs"

    def __init__(self, answerer: Callable[[Message], Message | None] | None = None, id_prefix: str = "j"):
        self.answerer, self.id_prefix = answerer, id_prefix
        self.pending: dict[str, Message] = {}
        self.services: dict[str, str] = {}
        self.submitted: list[Message] = []
        self.forgotten: list[str] = []
        self.polled_pending: list[set[str]] = []
        self.dropped: list[str] = []
        self.closed = False
        self.link = InMemoryLink()
        self._inbox: list[tuple[str, Message]] = []
        self._cond = threading.Condition()

    def submit(self, msg: Message, service: str = "", job_id: str | None = None) -> str:
        with self._cond:
            self.submitted.append(msg)
            job_id = job_id or f"{self.id_prefix}{len(self.submitted)}"
            self.pending[job_id] = msg
            self.services[job_id] = service
            self._cond.notify_all()  # an `answerer` may answer it at once
            return job_id

    def answer(self, job_id: str, msg: Message) -> None:
        """Queue `msg` as the answer to `job_id`; the next poll delivers it."""
        with self._cond:
            self._inbox.append((job_id, msg))
            self._cond.notify_all()

    def poll(self, timeout: float = 0.0) -> list[tuple[str, Message]]:
        with self._cond:
            self.polled_pending.append(set(self.pending))
            out = self._take()
            if not out and timeout > 0:
                self._cond.wait(timeout)
                out = self._take()
            return out

    def _take(self) -> list[tuple[str, Message]]:
        if self.answerer is not None:
            for job_id, msg in list(self.pending.items()):
                reply = self.answerer(msg)
                if reply is not None:
                    self._inbox.append((job_id, reply))
        out = []
        for job_id, msg in self._inbox:
            if job_id not in self.pending:
                self.dropped.append(job_id)
            else:  # a GeneratePartial (a streamed job's tokens so far) leaves the job pending, as in JobClient
                if msg.kind != Kind.GENERATE_PARTIAL:
                    del self.pending[job_id]
                out.append((job_id, msg))
        self._inbox = []
        return out

    def forget(self, job_id: str) -> bool:
        with self._cond:
            self.forgotten.append(job_id)
            return self.pending.pop(job_id, None) is not None

    def close(self) -> None:
        self.closed = True


class InMemoryStore:
    """The sample store's `put` as a list: `samples`, in the order they were put."""

    def __init__(self):
        self.samples: list[Any] = []

    def put(self, sample: Any, timeout: float | None = None) -> None:
        self.samples.append(sample)


class ManualClock:
    """A monotonic clock the test moves: `clock()` is `now`; `advance(dt)` moves it forward (never back)."""

    def __init__(self, now: float = 0.0):
        self.now = float(now)

    def __call__(self) -> float:
        return self.now

    def advance(self, dt: float) -> float:
        if dt < 0:
            raise ValueError(f"a monotonic clock does not go back (advance({dt}))")
        self.now += dt
        return self.now
