"""The job broker's dispatch policy (brokers/dispatch.py) without a socket: plain tables in, assignments out.

Least-loaded choice and its ties, credits as backpressure, per-task routing, sticky sessions (home, parking,
expiry, fallback), freed credits, requeue order at the front, worker loss, admission; then a Hypothesis state
machine that drives random workers and jobs through the same functions and checks the invariants the broker
promises (no job to a worker without credit, every job assigned once or still waiting, none lost).
"""
from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from areal_mq.brokers import dispatch
from areal_mq.brokers.dispatch import JobState, Pool, WorkerState
from areal_mq.brokers.sticky import StickySessions


def _pool(wait_s: float = 1.0, max_sessions: int = 100) -> Pool:
    return Pool(StickySessions(max_sessions, wait_s))


def _worker(pool: Pool, name: str, capacity: int, service: str = "gen", tasks=(), now: float = 0.0):
    w = WorkerState(name.encode(), name, service, capacity, now, frozenset(tasks))
    dispatch.add_worker(pool, w)
    return w, dispatch.freed(pool, w, now)


def _job(pool: Pool, job_id: str, service: str = "gen", *, task=None, session="", now: float = 0.0,
         max_queue: int = 1000):
    return dispatch.enqueue(pool, JobState(job_id, b"client", service, [job_id], "kind", task, session=session),
                            max_queue, now)


def _names(assignments) -> list[tuple[str, str]]:
    return [(a.job.id, a.worker.worker_id) for a in assignments]


def _done(pool: Pool, job_id: str, now: float = 0.0):
    job = pool.jobs[job_id]
    worker = pool.workers[job.worker]
    dispatch.finish(pool, worker, job)
    return dispatch.freed(pool, worker, now)


# ------------------------------------------------------------ least loaded, ties, credits
def test_each_job_goes_to_the_worker_with_most_credit_and_ties_to_the_first_registered():
    pool = _pool()
    _worker(pool, "a", 2)
    _worker(pool, "b", 4)
    got = [_names(_job(pool, f"j{i}")) for i in range(6)]
    # b 4 free, b 3, then a 2 = b 2: a (registered first), b 2 > a 1: b, a 1 = b 1: a, then b
    assert got == [[("j0", "b")], [("j1", "b")], [("j2", "a")], [("j3", "b")], [("j4", "a")], [("j5", "b")]]
    assert [w.free for w in pool.workers.values()] == [0, 0]


def test_least_loaded_skips_full_and_draining_workers_and_says_none_when_nobody_has_credit():
    full = WorkerState(b"f", "f", "gen", 1, 0.0, in_flight={"x"})
    draining = WorkerState(b"d", "d", "gen", 0, 0.0)
    assert dispatch.least_loaded([full, draining]) is None
    some = WorkerState(b"s", "s", "gen", 1, 0.0)
    assert dispatch.least_loaded([full, draining, some]) is some
    picky = WorkerState(b"p", "p", "gen", 3, 0.0, frozenset({"x"}))
    assert dispatch.least_loaded([picky, some]) is picky  # no task: credit decides
    assert dispatch.least_loaded([picky, some], task="y") is some  # lists no tasks: serves any
    assert dispatch.least_loaded([picky], task="y") is None


def test_credits_are_the_backpressure_and_a_freed_slot_takes_the_oldest_queued_job():
    pool = _pool()
    _worker(pool, "a", 1)
    _worker(pool, "b", 2)
    sent = [a for i in range(5) for a in _job(pool, f"j{i}")]
    assert len(sent) == 3 and list(pool.queues["gen"]) == ["j3", "j4"]
    assert all(w.free == 0 for w in pool.workers.values())
    assert pool.jobs["j1"].worker == b"a"
    assert _names(_done(pool, "j1")) == [("j3", "a")]
    assert list(pool.queues["gen"]) == ["j4"] and "j1" not in pool.jobs


def test_a_worker_registering_takes_the_waiting_jobs_and_one_draining_takes_none():
    pool = _pool()
    assert _job(pool, "j0") == [] and _job(pool, "j1") == []  # nobody serves yet: the jobs wait
    _, sent = _worker(pool, "idle", 0)
    assert sent == [] and list(pool.queues["gen"]) == ["j0", "j1"]
    w, sent = _worker(pool, "a", 3)
    assert _names(sent) == [("j0", "a"), ("j1", "a")]
    dispatch.update_worker(pool, w, 0, frozenset(), now=5.0)  # READY(0): pause
    assert _job(pool, "j2") == [] and w.last_seen == 5.0
    dispatch.update_worker(pool, w, 3, frozenset(), now=6.0)
    assert _names(dispatch.freed(pool, w, 6.0)) == [("j2", "a")]


def test_a_full_queue_refuses_and_changes_nothing():
    pool = _pool()
    assert _job(pool, "j0", max_queue=1) == []
    assert _job(pool, "j1", max_queue=1) is None
    assert "j1" not in pool.jobs and list(pool.queues["gen"]) == ["j0"] and pool.counters["queue_full"] == 1


# ------------------------------------------------------------ per-task routing
def test_jobs_go_only_to_workers_serving_their_task_and_the_others_keep_their_place():
    pool = _pool()
    _worker(pool, "x_only", 1, "rew", tasks={"x"})
    _worker(pool, "y_only", 2, "rew", tasks={"y"})
    assert pool.restricted["rew"] == 2
    assert _names(_job(pool, "y1", "rew", task="y")) == [("y1", "y_only")]
    assert _names(_job(pool, "x1", "rew", task="x")) == [("x1", "x_only")]
    assert _job(pool, "x2", "rew", task="x") == []  # x_only is full: it waits although y_only has credit
    assert _names(_job(pool, "y2", "rew", task="y")) == [("y2", "y_only")]  # ... and does not block y2
    assert _job(pool, "x3", "rew", task="x") == []
    assert list(pool.queues["rew"]) == ["x2", "x3"]
    assert _names(_done(pool, "x1")) == [("x2", "x_only")]  # in queue order
    assert list(pool.queues["rew"]) == ["x3"]


def test_a_worker_listing_no_tasks_serves_any_task_and_is_the_freest_fallback():
    pool = _pool()
    _worker(pool, "x_only", 1, "rew", tasks={"x"})
    _worker(pool, "any", 2, "rew")
    assert pool.restricted["rew"] == 1
    assert _names(_job(pool, "x1", "rew", task="x")) == [("x1", "any")]  # most credit, serves x too
    assert _names(_job(pool, "z1", "rew", task="z")) == [("z1", "any")]
    assert _names(_job(pool, "x2", "rew", task="x")) == [("x2", "x_only")]


def test_task_routing_looks_at_most_task_scan_jobs_per_call():
    pool = _pool()
    for i in range(dispatch.TASK_SCAN + 5):
        _job(pool, f"x{i}", "rew", task="x", max_queue=10**6)
    _job(pool, "y", "rew", task="y", max_queue=10**6)  # behind the scan window
    _, sent = _worker(pool, "y_only", 1, "rew", tasks={"y"})
    assert sent == [] and len(pool.queues["rew"]) == dispatch.TASK_SCAN + 6
    assert pool.queues["rew"][0] == "x0"  # the jobs looked at keep their order


def test_task_refusal_names_the_served_tasks_only_once_some_worker_lists_tasks():
    pool = _pool()
    assert dispatch.task_refusal(pool, "rew", "x") is None  # nobody registered: the job may wait
    _worker(pool, "any", 1, "rew")
    assert dispatch.task_refusal(pool, "rew", "x") is None
    pool = _pool()
    _worker(pool, "a", 1, "rew", tasks={"y", "z"})
    why = dispatch.task_refusal(pool, "rew", "x")
    assert "serves task 'x'" in why and "['y', 'z']" in why and pool.counters["no_worker_for_task"] == 1
    assert dispatch.task_refusal(pool, "rew", "y") is None


def test_re_ready_with_other_tasks_keeps_the_restricted_count_in_step():
    pool = _pool()
    w, _ = _worker(pool, "a", 1, "rew", tasks={"x"})
    dispatch.update_worker(pool, w, 1, frozenset(), now=1.0)
    assert pool.restricted["rew"] == 0
    dispatch.update_worker(pool, w, 1, frozenset({"y"}), now=2.0)
    assert pool.restricted["rew"] == 1 and w.tasks == {"y"}


# ------------------------------------------------------------ sticky sessions
def test_a_session_returns_to_its_worker_while_it_has_credit():
    pool = _pool()
    _worker(pool, "a", 2)
    _worker(pool, "b", 2)
    assert _names(_job(pool, "t1", session="s")) == [("t1", "a")]
    assert _names(_job(pool, "t2", session="s")) == [("t2", "a")]  # b has more credit, a holds the session
    assert pool.counters["sticky_hits"] == 1 and pool.sticky.home("s") == b"a"


def test_a_full_home_parks_the_job_which_it_serves_first_when_it_frees_a_slot():
    pool = _pool(wait_s=1.0)
    _worker(pool, "a", 2)
    _worker(pool, "b", 2)
    assert _names(_job(pool, "t1", session="s")) == [("t1", "a")]
    assert _names(_job(pool, "t2", session="s")) == [("t2", "a")]
    assert _job(pool, "t3", session="s", now=0.5) == []  # a full: parked on it although b has credit
    assert pool.sticky.parked_count() == 1 and pool.jobs["t3"].waited and pool.counters["sticky_parked"] == 1
    assert [_names(_job(pool, q)) for q in ("q1", "q2", "q3")] == [[("q1", "b")], [("q2", "b")], []]
    # a frees a slot: the parked turn first (its KV is there), the older queued job waits for the next one
    assert _names(_done(pool, "t1", now=0.6)) == [("t3", "a")]
    assert list(pool.queues["gen"]) == ["q3"]


def test_a_parked_job_whose_wait_ran_out_goes_to_the_front_and_to_any_worker():
    pool = _pool(wait_s=1.0)
    _worker(pool, "a", 1)
    _worker(pool, "b", 1)
    _job(pool, "t1", session="s")  # a
    assert _job(pool, "t2", session="s", now=2.0) == []  # parked on a until 3.0
    assert _names(_job(pool, "q1", now=2.0)) == [("q1", "b")]
    assert _job(pool, "q2", now=2.0) == []
    assert dispatch.expire_parked(pool, now=2.9) == [] and pool.sticky.parked_count() == 1
    assert dispatch.expire_parked(pool, now=3.0) == []  # back in the queue, before q2; nobody has credit
    assert list(pool.queues["gen"]) == ["t2", "q2"] and pool.counters["sticky_expired"] == 1
    _, sent = _worker(pool, "c", 1, now=3.1)
    # t2 waited once already: any worker, so c takes it although a holds the session
    assert _names(sent) == [("t2", "c")] and pool.counters["sticky_fallbacks"] == 1
    assert pool.sticky.home("s") == b"c"


def test_no_wait_a_dead_home_or_one_of_another_service_means_the_freest_worker():
    pool = _pool(wait_s=0.0)
    _worker(pool, "a", 1)
    _worker(pool, "b", 1)
    _job(pool, "t1", session="s")  # a
    assert _names(_job(pool, "t2", session="s")) == [("t2", "b")]  # a full and waiting is off: fallback
    pool = _pool(wait_s=1.0)
    _worker(pool, "a", 1)
    _worker(pool, "b", 2)
    pool.sticky.remember("s", b"a")
    dispatch.remove_worker(pool, b"a")
    assert _names(_job(pool, "t1", session="s")) == [("t1", "b")]
    pool.sticky.remember("s2", b"r")
    _worker(pool, "r", 5, "rew")
    assert _names(_job(pool, "t2", session="s2")) == [("t2", "b")]  # its home serves another service


def test_a_draining_home_hands_its_parked_jobs_back_to_the_front():
    pool = _pool(wait_s=5.0)
    a, _ = _worker(pool, "a", 1)
    _worker(pool, "b", 1)
    _job(pool, "t1", session="s")  # a
    _job(pool, "t2", session="s")  # parked on a
    _job(pool, "q1")  # b
    _job(pool, "q2")
    dispatch.update_worker(pool, a, 0, frozenset(), now=1.0)
    assert dispatch.freed(pool, a, 1.0) == []
    assert list(pool.queues["gen"]) == ["t2", "q2"] and pool.sticky.parked_count() == 0


# ------------------------------------------------------------ requeue and worker loss
def test_requeue_front_keeps_order_and_skips_jobs_no_longer_known():
    pool = _pool()
    for j in ("j0", "j1", "j2"):
        _job(pool, j)
    pool.queues["gen"].remove("j0")  # as if they had been handed out
    pool.queues["gen"].remove("j1")
    dispatch.requeue_front(pool, "gen", ["j1", "gone", "j0"])
    assert list(pool.queues["gen"]) == ["j1", "j0", "j2"]
    dispatch.requeue_front(pool, "other", [])
    assert "other" not in pool.queues  # nothing to put back creates no queue


def test_a_lost_worker_s_jobs_go_back_to_the_front_in_flight_before_parked_then_to_others():
    pool = _pool(wait_s=5.0)
    _worker(pool, "a", 2)
    _job(pool, "j2", session="s")  # a: the session's home
    _job(pool, "j1")  # a
    _worker(pool, "b", 1)
    _job(pool, "t2", session="s")  # a is full: parked on it
    assert [_names(_job(pool, q)) for q in ("q1", "q2")] == [[("q1", "b")], []]
    worker, requeued = dispatch.remove_worker(pool, b"a")
    assert worker.worker_id == "a" and requeued == 2
    assert list(pool.queues["gen"]) == ["j1", "j2", "t2", "q2"]  # in flight (by id), parked, then the queue
    assert pool.jobs["j1"].worker is None and pool.sticky.home("s") is None and pool.sticky.parked_count() == 0
    _, sent = _worker(pool, "c", 10)
    assert _names(sent) == [("j1", "c"), ("j2", "c"), ("t2", "c"), ("q2", "c")]
    assert pool.jobs["j1"].attempts == 2 and dispatch.remove_worker(pool, b"a") is None


def test_a_service_nobody_serves_and_nothing_waits_for_is_forgotten():
    pool = _pool()
    _worker(pool, "a", 1, "rew", tasks={"x"})
    _job(pool, "x1", "rew", task="x")
    _done(pool, "x1")
    dispatch.remove_worker(pool, b"a")
    assert "rew" not in pool.by_service and "rew" not in pool.queues and "rew" not in pool.restricted
    _worker(pool, "b", 0, "gen")
    _job(pool, "g1")
    dispatch.remove_worker(pool, b"b")
    assert "gen" not in pool.by_service and list(pool.queues["gen"]) == ["g1"]  # a job still waits for it


def test_service_refusal_bounds_the_number_of_services():
    pool = _pool()
    _worker(pool, "a", 1, "s1")
    _job(pool, "j", "s2")
    assert dispatch.service_refusal(pool, "s1", max_services=2) is None  # exists
    assert dispatch.service_refusal(pool, "s2", max_services=2) is None
    why = dispatch.service_refusal(pool, "s3", max_services=2)
    assert "max_services (2)" in why and "'s3'" in why and pool.counters["too_many_services"] == 1
    assert dispatch.service_refusal(pool, "s3", max_services=3) is None


# ------------------------------------------------------------ properties
SERVICES, TASKS, SESSIONS = ("gen", "rew"), (None, "x", "y"), ("", "", "s1", "s2", "s3")


class DispatchMachine(RuleBasedStateMachine):
    """Random workers come, drain and go, random jobs arrive and are answered, time passes."""

    @initialize(wait_s=st.sampled_from([0.0, 0.5, 2.0]))
    def start(self, wait_s):
        self.pool = _pool(wait_s=wait_s, max_sessions=2)
        self.now, self.n_workers, self.n_jobs, self.finished = 0.0, 0, 0, 0
        self.outstanding: dict[str, bytes] = {}  # job id -> the worker it was delivered to, not yet answered

    def _take(self, assignments):
        for job, worker in assignments:
            assert job.id not in self.outstanding, f"{job.id} assigned twice"
            assert worker.ident in self.pool.workers and job.worker == worker.ident and job.id in worker.in_flight
            assert job.service == worker.service and worker.serves(job.task)
            assert len(worker.in_flight) <= worker.capacity, "assigned to a worker without credit"
            self.outstanding[job.id] = worker.ident

    @rule(service=st.sampled_from(SERVICES), capacity=st.integers(0, 3),
          tasks=st.sampled_from([(), ("x",), ("y",), ("x", "y")]))
    def add_worker(self, service, capacity, tasks):
        self.n_workers += 1
        _, sent = _worker(self.pool, f"w{self.n_workers}", capacity, service, tasks, now=self.now)
        self._take(sent)

    @rule(service=st.sampled_from(SERVICES), task=st.sampled_from(TASKS), session=st.sampled_from(SESSIONS))
    def submit(self, service, task, session):
        self.n_jobs += 1
        sent = _job(self.pool, f"j{self.n_jobs:04d}", service, task=task, session=session, now=self.now)
        self._take(sent)

    @precondition(lambda self: self.outstanding)
    @rule(data=st.data())
    def answer(self, data):
        job_id = data.draw(st.sampled_from(sorted(self.outstanding)))
        del self.outstanding[job_id]
        self.finished += 1
        self._take(_done(self.pool, job_id, self.now))

    @precondition(lambda self: self.pool.workers)
    @rule(data=st.data(), capacity=st.integers(0, 3))
    def re_ready(self, data, capacity):
        worker = self.pool.workers[data.draw(st.sampled_from(sorted(self.pool.workers)))]
        dispatch.update_worker(self.pool, worker, capacity, worker.tasks, self.now)
        self._take(dispatch.freed(self.pool, worker, self.now))

    @precondition(lambda self: self.pool.workers)
    @rule(data=st.data())
    def lose_worker(self, data):
        ident = data.draw(st.sampled_from(sorted(self.pool.workers)))
        worker, requeued = dispatch.remove_worker(self.pool, ident)
        lost = [j for j, w in self.outstanding.items() if w == ident]
        assert requeued == len(lost)
        for j in lost:
            del self.outstanding[j]
        self._take(dispatch.dispatch(self.pool, worker.service, self.now))

    @rule(dt=st.sampled_from([0.1, 0.6, 3.0]))
    def time_passes(self, dt):
        self.now += dt
        self._take(dispatch.expire_parked(self.pool, self.now))

    @invariant()
    def every_job_is_in_exactly_one_place_and_none_is_lost(self):
        if not hasattr(self, "pool"):
            return
        pool = self.pool
        assert self.finished + len(pool.jobs) == self.n_jobs
        queued = [j for q in pool.queues.values() for j in q]
        parked = [j for p in pool.sticky.waiting.values() for j in p]
        in_flight = [j for w in pool.workers.values() for j in w.in_flight]
        places = queued + parked + in_flight
        assert sorted(places) == sorted(pool.jobs), "a job is in two places, or in none"
        assert set(in_flight) == set(self.outstanding)

    @invariant()
    def no_queued_job_waits_while_a_worker_that_serves_it_has_credit(self):
        if not hasattr(self, "pool"):
            return
        for service, queue in self.pool.queues.items():
            free = [w for w in self.pool.by_service.get(service, {}).values() if w.free > 0]
            for job_id in queue:
                job = self.pool.jobs[job_id]
                assert not any(w.serves(job.task) for w in free), f"{job_id} waits beside a free worker"


DispatchMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
test_dispatch_invariants_hold_under_random_workers_and_jobs = DispatchMachine.TestCase
