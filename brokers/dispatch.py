"""The job broker's dispatch policy, sans I/O: which worker gets which job, and what happens when one goes.

What: the decisions the job broker (brokers/job_broker.py) and the in-process StubBroker (brokers/stub.py)
share. Plain data in: a `Pool` (queues of job ids, workers with their capacity and in-flight jobs, the jobs,
the sticky sessions of brokers/sticky.py, counters) and `now` as a number; decisions out: a list of
`Assignment`s, (job, worker) pairs, that the caller delivers (the broker sends the job's frames to the
worker's socket). No socket, no clock, no log here, so every rule is a unit test away
(tests/unit/brokers/test_dispatch.py).

Why functions that update the Pool they are given rather than return a new one: a dispatch consumes its
queue as it assigns, and copying a queue of thousands of ids per job would make dispatch O(queue) per job
on the broker's hot path. They keep no state of their own: the same Pool and `now` give the same decisions.

Rules (the broker's invariants rest on them):
- credits are the backpressure: a worker gets a job only while its credit (capacity - in flight) is > 0;
- a job goes to the worker of its service with the most credit; ties go to the one registered first;
- while some worker of a service lists tasks (`restricted`), each job, in queue order, goes to the freest
  worker serving its task; one no free worker serves keeps its place (at most TASK_SCAN looked at per call);
- a job with a session goes to the session's last worker if it has credit; if that one is full the job is
  parked on it (once, for at most the sticky wait) and served first when it frees a slot; otherwise (new
  session, worker gone or of another service, parked once already) the freest worker takes it;
- jobs put back (a lost worker's in flight, parked ones that expired or whose worker drains) go to the
  front of their queue, oldest first; a lost worker's in-flight jobs go before its parked ones;
- every job is at any time queued, parked, or assigned to one worker; each assignment is returned once;
- a job assigned holds a lease (`Leases`: brokers.job_deadline_s, per service); one not answered when its
  lease ends is taken back (`overdue`): its worker's slot is freed and it goes to the front of its queue,
  for another worker of the service when one has credit; after `max_attempts` assignments it fails instead.
"""
from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from .sticky import StickySessions

TASK_SCAN = 1024  # queued jobs one dispatch looks through for a task a free worker serves (then they wait)


@dataclass(frozen=True)
class Leases:
    """How long a worker may hold a job of each service before the broker takes it back (0: for ever)."""
    default_s: float = 0.0
    per_service: dict[str, float] = field(default_factory=dict)
    max_attempts: int = 3  # assignments before an overdue job fails instead of being requeued

    def of(self, service: str) -> float:
        return self.per_service.get(service, self.default_s)


@dataclass
class WorkerState:
    ident: bytes
    worker_id: str
    service: str
    capacity: int
    last_seen: float
    tasks: frozenset[str] = frozenset()  # empty: any job of the service
    in_flight: set[str] = field(default_factory=set)

    @property
    def free(self) -> int:
        return self.capacity - len(self.in_flight)

    def serves(self, task: str | None) -> bool:
        return task is None or not self.tasks or task in self.tasks


@dataclass
class JobState:
    id: str
    client: bytes
    service: str
    frames: list[Any]  # what the worker receives: wire frames (broker), [message] (StubBroker)
    kind: Any  # messages.Kind
    task: str | None = None  # reward_job: routes only to workers serving it
    n_items: int = 0  # reward_job: completions, the rewards a reward_result must carry
    worker: bytes | None = None
    attempts: int = 0
    session: str = ""  # generate_request: routes to the session's last worker (sticky.py)
    waited: bool = False  # parked once for its session's worker already: now any worker
    queued_at: float = 0.0  # when the broker accepted it (`now` of enqueue): queue wait, dispatch latency
    due: float = 0.0  # while assigned: when its lease ends (0: never)
    avoid: bytes | None = None  # the worker it was taken back from (overdue): another one first


class Assignment(NamedTuple):
    """A decision: deliver `job` to `worker` (already recorded: job.worker set, worker.in_flight holds it)."""
    job: JobState
    worker: WorkerState


@dataclass
class Pool:
    """Everything the dispatch policy decides over; the broker's own tables (it keeps references to them)."""
    sticky: StickySessions
    workers: dict[bytes, WorkerState] = field(default_factory=dict)
    by_service: dict[str, dict[bytes, WorkerState]] = field(default_factory=dict)  # registration order
    restricted: collections.Counter = field(default_factory=collections.Counter)  # service -> workers listing tasks
    queues: dict[str, collections.deque[str]] = field(default_factory=dict)  # job ids, oldest first
    jobs: dict[str, JobState] = field(default_factory=dict)  # queued, parked and in flight
    counters: collections.Counter = field(default_factory=collections.Counter)
    leases: Leases = field(default_factory=Leases)


class Overdue(NamedTuple):
    """A job taken back from `worker` when its lease ended: requeued, or `failed` (tried max_attempts times)."""
    job: JobState
    worker: WorkerState
    failed: bool


# ------------------------------------------------------------ choices
def least_loaded(workers, task: str | None = None) -> WorkerState | None:
    """The worker with the most credit (first of equals) that serves `task`; None when none has credit."""
    best = None
    for w in workers:
        if w.free > 0 and (best is None or w.free > best.free) and (task is None or w.serves(task)):
            best = w
    return best


def sticky_choice(pool: Pool, job: JobState, best: WorkerState, now: float) -> WorkerState | None:
    """The worker for a job with a session: its last worker if that one has credit; else park the job on
    it (None) for at most the sticky wait, once; else `best` (a new session, a dead or draining worker)."""
    home = pool.workers.get(pool.sticky.home(job.session) or b"")
    if home is None or home.service != job.service:
        return best
    if home.free > 0:
        pool.counters["sticky_hits"] += 1
        return home
    if not job.waited and pool.sticky.park(job.id, home.ident, home.capacity, now):
        job.waited = True
        pool.counters["sticky_parked"] += 1
        return None
    pool.counters["sticky_fallbacks"] += 1
    return best


def assign(pool: Pool, job: JobState, worker: WorkerState, now: float) -> Assignment:
    """Record `job` as in flight on `worker` (one more attempt, a new lease; its session now lives there)."""
    job.worker, job.attempts = worker.ident, job.attempts + 1
    lease = pool.leases.of(job.service)
    job.due = now + lease if lease > 0 else 0.0
    worker.in_flight.add(job.id)
    if job.session:
        pool.sticky.remember(job.session, worker.ident)
    return Assignment(job, worker)


# ------------------------------------------------------------ dispatch
def dispatch(pool: Pool, service: str, now: float) -> list[Assignment]:
    """Give `service`'s queued jobs, oldest first, to its workers while some have credit."""
    queue = pool.queues.get(service)
    candidates = pool.by_service.get(service)
    if not queue or not candidates:
        return []
    if pool.restricted.get(service):
        return dispatch_by_task(pool, queue, candidates, now)
    out = []
    jobs = pool.jobs
    while queue:
        best = least_loaded(candidates.values())
        if best is None:
            break
        job = jobs.get(queue.popleft())
        if job is not None and job.session:
            best = sticky_choice(pool, job, best, now)
        if job is not None and best is not None:
            out.append(assign(pool, job, elsewhere(candidates.values(), job, best), now))
    return out


def dispatch_by_task(pool: Pool, queue: collections.deque, candidates: dict[bytes, WorkerState], now: float
                     ) -> list[Assignment]:
    """Some workers serve only some tasks: give each job, in queue order, the freest worker serving it.

    A job no free worker serves keeps its place; at most TASK_SCAN jobs are looked at per call."""
    out: list[Assignment] = []
    kept: list[str] = []
    for _ in range(min(len(queue), TASK_SCAN)):
        free = [w for w in candidates.values() if w.free > 0]
        if not free:
            break
        job = pool.jobs.get(queue.popleft())
        if job is None:
            continue
        best = least_loaded(free, job.task)
        if best is None:
            kept.append(job.id)
        else:
            out.append(assign(pool, job, elsewhere(free, job, best), now))
    queue.extendleft(reversed(kept))
    return out


def elsewhere(workers, job: JobState, best: WorkerState) -> WorkerState:
    """`best`, unless the job was taken back from it (overdue) and another worker serving it has credit."""
    if job.avoid is None or best.ident != job.avoid:
        return best
    return least_loaded([w for w in workers if w.ident != job.avoid], job.task) or best


def freed(pool: Pool, worker: WorkerState, now: float) -> list[Assignment]:
    """`worker` has credit again: first the jobs parked waiting for it (their sessions), then its queue.
    A worker now draining (capacity 0) frees nothing: its parked jobs go back to the queue's front."""
    out = []
    if worker.capacity <= 0:
        requeue_front(pool, worker.service, pool.sticky.release(worker.ident))
    while worker.free > 0:
        job_id = pool.sticky.next_parked(worker.ident)
        if job_id is None:
            break
        job = pool.jobs.get(job_id)
        if job is not None:
            pool.counters["sticky_hits"] += 1
            out.append(assign(pool, job, worker, now))
    out += dispatch(pool, worker.service, now)
    return out


def expire_parked(pool: Pool, now: float) -> list[Assignment]:
    """Parked jobs that waited the sticky wait go back to the front of their queue, for any worker."""
    by_service: dict[str, list[str]] = {}
    for job_id in pool.sticky.expired(now):
        job = pool.jobs.get(job_id)
        if job is not None:
            pool.counters["sticky_expired"] += 1
            by_service.setdefault(job.service, []).append(job_id)
    out = []
    for service, job_ids in by_service.items():
        requeue_front(pool, service, job_ids)
        out += dispatch(pool, service, now)
    return out


def overdue(pool: Pool, now: float) -> tuple[list[Assignment], list[Overdue]]:
    """Take back every in-flight job whose lease ended before `now`: its worker's slot is freed, and the job
    goes to the front of its queue (for another worker when one has credit: `avoid`), or, assigned
    `max_attempts` times already, is forgotten and reported `failed` (the caller answers its client).
    Returns the new assignments and the overdue jobs, for the caller to log (and answer the failed ones)."""
    late: list[Overdue] = []
    for worker in list(pool.workers.values()):
        for job_id in sorted(worker.in_flight):
            job = pool.jobs.get(job_id)
            if job is None or not 0 < job.due <= now:
                continue
            worker.in_flight.discard(job_id)
            failed = job.attempts >= pool.leases.max_attempts
            if failed:
                del pool.jobs[job_id]
            else:
                job.worker, job.due, job.avoid = None, 0.0, worker.ident
            pool.counters["deadline_failed" if failed else "deadline_requeued"] += 1
            late.append(Overdue(job, worker, failed))
    out: list[Assignment] = []
    by_service: dict[str, list[str]] = {}
    for o in late:
        if not o.failed:
            by_service.setdefault(o.job.service, []).append(o.job.id)
    for service, job_ids in by_service.items():
        requeue_front(pool, service, job_ids)
    for worker in {id(o.worker): o.worker for o in late}.values():
        if worker.ident in pool.workers:
            out += freed(pool, worker, now)
    return out, late


def overdue_failure(pool: Pool, late: Overdue) -> str:
    """What the client of a job that ran out of attempts is told (job broker and StubBroker alike)."""
    job, worker = late.job, late.worker
    return (f"no worker answered job {job.id} (service {job.service!r}) within its lease of "
            f"{pool.leases.of(job.service):g}s, {job.attempts} time(s); last worker {worker.worker_id!r}. Check that "
            "workers answer every job with reply_to = the job id, or raise brokers.job_deadline_s / "
            "brokers.job_deadlines")


def requeue_front(pool: Pool, service: str, job_ids: list[str]) -> None:
    """Put `job_ids` (oldest first) back at the front of their queue, in order; unknown ids are skipped."""
    queue = pool.queues.setdefault(service, collections.deque()) if job_ids else None
    for job_id in reversed(job_ids):
        if job_id in pool.jobs:
            queue.appendleft(job_id)


# ------------------------------------------------------------ jobs and workers coming and going
def enqueue(pool: Pool, job: JobState, max_queue: int, now: float) -> list[Assignment] | None:
    """Queue `job` behind its service's queue and dispatch; None (nothing changed) when that queue already
    holds `max_queue` jobs. The caller checked the service may exist (service_refusal)."""
    queue = pool.queues.get(job.service)
    if queue is None:
        queue = pool.queues[job.service] = collections.deque()
    if len(queue) >= max_queue:
        pool.counters["queue_full"] += 1
        return None
    pool.jobs[job.id] = job
    queue.append(job.id)
    job.queued_at = now
    pool.counters["accepted"] += 1
    return dispatch(pool, job.service, now)


def finish(pool: Pool, worker: WorkerState, job: JobState) -> None:
    """`job` is answered (or failed) by `worker`: forget it and free its slot; then call freed()."""
    worker.in_flight.discard(job.id)
    del pool.jobs[job.id]


def add_worker(pool: Pool, worker: WorkerState) -> None:
    """Register a new worker (the caller checked service_refusal); then call freed() to give it work."""
    pool.workers[worker.ident] = worker
    pool.by_service.setdefault(worker.service, {})[worker.ident] = worker
    pool.restricted[worker.service] += bool(worker.tasks)


def update_worker(pool: Pool, worker: WorkerState, capacity: int, tasks: frozenset[str], now: float) -> None:
    """A registered worker re-announced itself (capacity 0: draining); then call freed()."""
    pool.restricted[worker.service] += bool(tasks) - bool(worker.tasks)
    worker.capacity, worker.last_seen, worker.tasks = capacity, now, tasks


def remove_worker(pool: Pool, ident: bytes) -> tuple[WorkerState, int] | None:
    """Forget worker `ident` (lost or disconnected): its in-flight jobs go back to the front of their queue
    (before the jobs parked on it), a service nobody serves and nothing waits for is forgotten. Returns the
    worker and how many jobs were requeued (None: unknown); then call dispatch() for its service."""
    worker = pool.workers.pop(ident, None)
    if worker is None:
        return None
    service = worker.service
    pool.by_service[service].pop(ident, None)
    pool.restricted[service] -= bool(worker.tasks)
    requeue_front(pool, service, pool.sticky.forget_worker(ident))  # parked on it: now any worker
    requeued = 0
    for job_id in sorted(worker.in_flight, reverse=True):
        job = pool.jobs.get(job_id)
        if job is not None:
            job.worker, job.due = None, 0.0
            pool.queues.setdefault(job.service, collections.deque()).appendleft(job_id)
            requeued += 1
    pool.counters["requeued"] += requeued
    if not pool.by_service[service]:  # forget a service nobody serves and nothing waits for (max_services)
        del pool.by_service[service]
        pool.restricted.pop(service, None)
        if not pool.queues.get(service, True):
            del pool.queues[service]
    return worker, requeued


# ------------------------------------------------------------ admission
def service_refusal(pool: Pool, service: str, max_services: int) -> str | None:
    """Why a new service may not be created (None: it exists, or there is room)."""
    if service in pool.queues or service in pool.by_service:
        return None
    if len(pool.queues.keys() | pool.by_service.keys()) < max_services:
        return None
    pool.counters["too_many_services"] += 1
    return (f"the broker already routes brokers.max_services ({max_services}) services; "
            f"service {service[:64]!r} is not one of them")


def task_refusal(pool: Pool, service: str, task: str) -> str | None:
    """A reward_job no registered worker of its service serves (None while none is registered at all)."""
    if not pool.restricted.get(service):
        return None
    workers = pool.by_service.get(service, {}).values()
    if any(w.serves(task) for w in workers):
        return None
    pool.counters["no_worker_for_task"] += 1
    served = sorted({t for w in workers for t in w.tasks})
    return (f"no worker of service {service!r} serves task {task[:128]!r}; its workers serve "
            f"{served[:20]}{' ...' if len(served) > 20 else ''}")


def stats(pool: Pool) -> dict:
    """The figures a Stats answer carries: workers with their load, queue lengths, sessions, counters."""
    return {
        "workers": {w.worker_id: {"service": w.service, "capacity": w.capacity, "in_flight": len(w.in_flight),
                                  "tasks": sorted(w.tasks)} for w in pool.workers.values()},
        "queued": {s: len(q) for s, q in pool.queues.items()},
        "in_flight": sum(1 for j in pool.jobs.values() if j.worker is not None),
        "sessions": len(pool.sticky.routes), "sticky_waiting": pool.sticky.parked_count(),
        "counters": dict(pool.counters),
    }
