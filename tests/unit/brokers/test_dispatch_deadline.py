"""Job leases in the dispatch policy (brokers/dispatch.py: Leases, overdue): a job not answered in time is
taken back from its worker, requeued at the front for another worker, and failed after max_attempts.

Pure functions with `now` passed in: no clock, no socket. Run: pytest tests/unit/brokers/test_dispatch_deadline.py
"""
from __future__ import annotations

from areal_mq.brokers import dispatch
from areal_mq.brokers.dispatch import JobState, Leases, Pool, WorkerState
from areal_mq.brokers.sticky import StickySessions


def _pool(default_s=10.0, per_service=None, max_attempts=3) -> Pool:
    return Pool(StickySessions(100, 1.0), leases=Leases(default_s, per_service or {}, max_attempts))


def _worker(pool, name, capacity=1, service="gen", now=0.0, tasks=()):
    w = WorkerState(name.encode(), name, service, capacity, now, frozenset(tasks))
    dispatch.add_worker(pool, w)
    return w, dispatch.freed(pool, w, now)


def _job(pool, job_id, service="gen", now=0.0, task=None):
    return dispatch.enqueue(pool, JobState(job_id, b"client", service, [job_id], "kind", task), 1000, now)


def _names(assignments):
    return [(a.job.id, a.worker.worker_id) for a in assignments]


def test_leases_per_service_override_the_default_and_zero_means_none():
    leases = Leases(300.0, {"agent": 1800.0, "echo": 0.0})
    assert leases.of("generate") == 300.0 and leases.of("agent") == 1800.0 and leases.of("echo") == 0.0
    pool = _pool(0.0)
    _worker(pool, "a")
    _job(pool, "j0")
    assert pool.jobs["j0"].due == 0.0
    assert dispatch.overdue(pool, 1e9) == ([], [])  # no lease: never taken back


def test_an_assigned_job_is_due_after_its_service_s_lease():
    pool = _pool(10.0, {"rew": 2.0})
    _worker(pool, "g")
    _worker(pool, "r", service="rew")
    _job(pool, "jg", now=5.0)
    _job(pool, "jr", "rew", now=5.0)
    assert pool.jobs["jg"].due == 15.0 and pool.jobs["jr"].due == 7.0
    assert dispatch.overdue(pool, 6.9) == ([], [])  # not yet


def test_an_overdue_job_frees_its_worker_s_slot_and_goes_to_another_worker_with_credit():
    pool = _pool(10.0)
    silent, _ = _worker(pool, "silent")
    assert _names(_job(pool, "j0")) == [("j0", "silent")]
    good, _ = _worker(pool, "good")  # registered after: the tie would go to "silent"
    sent, late = dispatch.overdue(pool, 10.0)
    assert [(o.job.id, o.worker.worker_id, o.failed) for o in late] == [("j0", "silent", False)]
    assert _names(sent) == [("j0", "good")]
    assert silent.free == 1 and good.free == 0  # the silent worker's slot is freed
    assert pool.jobs["j0"].attempts == 2 and pool.jobs["j0"].due == 20.0
    assert pool.counters["deadline_requeued"] == 1
    # a late reply from the silent worker no longer matches: the job is now good's
    assert pool.jobs["j0"].worker == b"good"


def test_an_overdue_job_with_no_other_worker_goes_back_to_the_same_one_rather_than_wait():
    pool = _pool(10.0)
    only, _ = _worker(pool, "only")
    _job(pool, "j0")
    sent, late = dispatch.overdue(pool, 11.0)
    assert _names(sent) == [("j0", "only")] and len(late) == 1


def test_an_overdue_job_waits_at_the_front_of_its_queue_when_every_worker_is_full():
    pool = _pool(10.0)
    _worker(pool, "a")
    _job(pool, "j0")
    _job(pool, "j1")
    assert list(pool.queues["gen"]) == ["j1"]
    pool.workers[b"a"].capacity = 0  # draining: takes nothing new
    sent, late = dispatch.overdue(pool, 10.0)
    assert sent == [] and list(pool.queues["gen"]) == ["j0", "j1"] and pool.jobs["j0"].worker is None


def test_a_job_overdue_max_attempts_times_fails_and_is_forgotten():
    pool = _pool(10.0, max_attempts=2)
    _worker(pool, "a")
    _job(pool, "j0")
    sent, late = dispatch.overdue(pool, 10.0)
    assert _names(sent) == [("j0", "a")] and not late[0].failed
    sent, late = dispatch.overdue(pool, 20.0)
    assert sent == [] and [(o.job.id, o.failed) for o in late] == [("j0", True)]
    assert "j0" not in pool.jobs and pool.workers[b"a"].free == 1
    assert pool.counters["deadline_failed"] == 1


def test_a_freed_slot_after_an_overdue_job_takes_the_next_queued_job():
    pool = _pool(10.0, max_attempts=1)
    _worker(pool, "a")
    _job(pool, "j0")
    _job(pool, "j1", now=3.0)
    sent, late = dispatch.overdue(pool, 10.0)
    assert [o.failed for o in late] == [True] and _names(sent) == [("j1", "a")]
    assert pool.jobs["j1"].due == 20.0  # its lease starts when it is assigned, not queued


def test_task_routing_also_prefers_another_worker_for_an_overdue_job():
    pool = _pool(10.0)
    _worker(pool, "x1", service="rew", tasks=("x",))
    _job(pool, "j0", "rew", task="x")
    _worker(pool, "x2", service="rew", tasks=("x",))
    _worker(pool, "y", service="rew", tasks=("y",))
    sent, _ = dispatch.overdue(pool, 10.0)
    assert _names(sent) == [("j0", "x2")]


def test_a_lost_worker_s_requeued_job_has_no_lease_until_assigned_again():
    pool = _pool(10.0)
    _worker(pool, "a")
    _job(pool, "j0")
    dispatch.remove_worker(pool, b"a")
    assert pool.jobs["j0"].due == 0.0 and dispatch.overdue(pool, 100.0) == ([], [])
