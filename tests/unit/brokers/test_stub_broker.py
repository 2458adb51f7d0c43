"""StubBroker (brokers/stub.py): the job broker's routing in process, as the test kit users get.

Round trips, least-loaded credits, per-task routing, sticky sessions on a stepped clock, a dying worker's jobs
requeued and its late reply dropped, bad replies and refusals answered as Errors, bad arguments refused, and
worker threads draining a burst (join). No socket, no sleep: blocking calls wait on the broker's condition.
"""
from __future__ import annotations

import threading

import numpy as np
import pytest

from areal_mq.brokers.dispatch import Leases
from areal_mq.brokers.stub import StubBroker
from areal_mq.errors import BrokerUnavailable, JobFailed
from areal_mq.messages import Error, GenerateRequest, GenerateResult, RewardJob, RewardResult
from areal_mq.testing import ManualClock

T = 5.0  # generous: a loaded 2-core machine; a passing test never waits this long


def _gen(session: str = "", prompt=(1, 2, 3)) -> GenerateRequest:
    return GenerateRequest(prompt_ids=list(prompt), session=session)


def _result(tokens=(7,)) -> GenerateResult:
    n = len(tokens)
    return GenerateResult(output_ids=list(tokens), logprobs=[-0.5] * n, versions=[0] * n, finish_reason="stop")


def _reward(task: str = "math", n: int = 1) -> RewardJob:
    return RewardJob(task=task, prompt="2+3?", completions=["5"] * n, reference="5")


def test_the_docstring_example_round_trips_a_reward_job():
    broker = StubBroker()
    worker = broker.worker("reward", capacity=2, tasks=["math"])
    client = broker.client()
    job_id = client.submit(RewardJob(task="math", prompt="2+3?", completions=["5"], reference="5"))
    got_id, job = worker.take(timeout=T)
    assert got_id == job_id and job.prompt == "2+3?" and job.completions == ["5"]
    assert worker.reply(got_id, RewardResult(rewards=[1.0]))
    assert client.wait(job_id, timeout=T).rewards == [1.0]
    stats = broker.stats()
    assert stats["counters"] == {"accepted": 1, "answered": 1} and stats["in_flight"] == 0
    assert client.pending == set() and worker.take() is None


def test_messages_cross_as_on_the_wire_so_the_worker_shares_no_array_with_the_client():
    broker = StubBroker()
    worker = broker.worker("generate", capacity=1)
    client = broker.client()
    request = _gen(prompt=(4, 5, 6))
    job_id = client.submit(request)  # GenerateRequest goes to service "generate" by default
    _, job = worker.take(timeout=T)
    assert job is not request and job.prompt_ids.dtype == np.int32 and list(job.prompt_ids) == [4, 5, 6]
    assert not np.shares_memory(job.prompt_ids, request.prompt_ids)
    worker.reply(job_id, _result((8, 9)))
    [(rid, answer)] = client.poll(timeout=T)
    assert rid == job_id and list(answer.output_ids) == [8, 9]


def test_credits_hold_jobs_back_and_each_goes_to_the_freest_worker():
    broker = StubBroker()
    small = broker.worker("generate", capacity=1, worker_id="small")
    big = broker.worker("generate", capacity=2, worker_id="big")
    client = broker.client()
    ids = [client.submit(_gen()) for _ in range(4)]
    assert broker.stats()["queued"] == {"generate": 1}
    big_jobs = [big.take()[0], big.take()[0]]
    assert big.take() is None and small.take()[0] == ids[1] and sorted(big_jobs) == sorted([ids[0], ids[2]])
    small.reply(ids[1], _result())
    assert small.take(timeout=T)[0] == ids[3]  # the freed credit takes the waiting job
    assert [rid for rid, _ in client.poll()] == [ids[1]]


def test_reward_jobs_go_only_to_workers_serving_their_task_and_unserved_tasks_are_refused():
    broker = StubBroker()
    math = broker.worker("reward", capacity=4, tasks=["math"])
    code = broker.worker("reward", capacity=4, tasks=["code"])
    client = broker.client()
    job_id = client.submit(_reward("code"))
    assert code.take()[0] == job_id and math.take() is None
    refused = client.submit(_reward("poetry"))
    with pytest.raises(JobFailed, match=r"no_service.*serves task 'poetry'"):
        client.wait(refused, timeout=T)


def test_a_session_sticks_to_its_worker_and_a_parked_turn_expires_to_another():
    clock = ManualClock(100.0)
    broker = StubBroker(sticky_wait_s=1.0, clock=clock)
    a = broker.worker("generate", capacity=1, worker_id="a")
    b = broker.worker("generate", capacity=1, worker_id="b")
    client = broker.client()
    t1 = client.submit(_gen("s"))
    assert a.take()[0] == t1
    a.reply(t1, _result())
    t2 = client.submit(_gen("s"))
    assert a.take()[0] == t2  # a has credit again: the session's turn returns to it
    t3 = client.submit(_gen("s"))  # a is full: t3 waits for it although b is free
    assert b.take() is None and broker.stats()["sticky_waiting"] == 1
    clock.advance(1.0)
    broker.tick()
    assert b.take()[0] == t3 and broker.stats()["counters"]["sticky_expired"] == 1


def test_a_dying_worker_s_jobs_go_to_another_and_its_late_reply_is_dropped():
    broker = StubBroker()
    doomed = broker.worker("generate", capacity=2)
    client = broker.client()
    # ids chosen: the broker requeues a lost worker's in-flight jobs in id order (uuid4 ids by default)
    first, second = client.submit(_gen(), job_id="j1"), client.submit(_gen(), job_id="j2")
    queued = client.submit(_gen(), job_id="j3")
    assert doomed.take()[0] == first  # taken, never answered
    doomed.die()
    assert not doomed.alive and doomed.take() is None
    heir = broker.worker("generate", capacity=3)
    assert [heir.take()[0] for _ in range(3)] == [first, second, queued]  # in flight first, in order
    assert not doomed.reply(first, _result())  # too late: the job is the heir's now
    assert heir.reply(first, _result())
    assert [rid for rid, _ in client.poll()] == [first]  # answered exactly once
    counters = broker.stats()["counters"]
    assert counters["workers_lost"] == 1 and counters["orphan_replies"] == 1
    assert not heir.reply(first, _result()) and broker.stats()["counters"]["duplicate_replies"] == 1


def test_a_reply_that_does_not_answer_the_job_reaches_the_client_as_bad_reply_and_frees_the_slot():
    broker = StubBroker()
    worker = broker.worker("reward", capacity=1)
    client = broker.client()
    job_id, waiting = client.submit(_reward(n=2)), client.submit(_reward())
    worker.take()
    assert worker.reply(job_id, RewardResult(rewards=[1.0]))  # one reward for two completions
    with pytest.raises(JobFailed, match="bad_reply.*1 rewards for 2 completion"):
        client.wait(job_id, timeout=T)
    assert worker.errors[0].code == "bad_reply" and worker.take()[0] == waiting


def test_an_error_reply_is_the_client_s_answer():
    broker = StubBroker()
    worker = broker.worker("generate")
    client = broker.client()
    job_id = client.submit(_gen())
    worker.take()
    worker.reply(job_id, Error(code="job_failed", message="engine fell over", ref_id=job_id))
    with pytest.raises(JobFailed, match="engine fell over"):
        client.wait(job_id, timeout=T)


def test_a_paused_worker_gets_nothing_until_it_resumes():
    broker = StubBroker()
    worker = broker.worker("generate", capacity=1)
    worker.set_capacity(0)
    client = broker.client()
    job_id = client.submit(_gen())
    assert worker.take() is None
    worker.set_capacity(1)
    assert worker.take()[0] == job_id


def test_full_queues_too_many_services_and_non_jobs_are_answered_with_errors():
    broker = StubBroker(max_queue=1, max_services=1)
    client = broker.client()
    client.submit(_gen())  # waits: nobody serves "generate" yet
    with pytest.raises(JobFailed, match="queue_full"):
        client.wait(client.submit(_gen()), timeout=T)
    with pytest.raises(JobFailed, match="no_service.*max_services"):
        client.wait(client.submit(_reward()), timeout=T)
    with pytest.raises(ValueError, match="max_services"):
        broker.worker("reward")
    with pytest.raises(JobFailed, match="bad_request.*not a job"):
        client.wait(client.submit(_result(), service="generate"), timeout=T)


def test_bad_arguments_are_refused_with_a_clear_error():
    broker = StubBroker(max_capacity=8)
    with pytest.raises(ValueError, match="capacity"):
        broker.worker("generate", capacity=-1)
    with pytest.raises(ValueError, match="capacity"):
        broker.worker("generate", capacity=9)
    with pytest.raises(ValueError, match="service"):
        broker.worker("", capacity=1)
    with pytest.raises(ValueError, match="list of task names"):
        broker.worker("reward", tasks="math")
    with pytest.raises(TypeError, match="messages message"):
        broker.client().submit({"prompt_ids": [1]})
    worker = broker.worker("generate")
    worker.disconnect()
    with pytest.raises(RuntimeError, match="left the broker"):
        worker.set_capacity(1)


def test_forget_drops_the_answer_and_wait_times_out_naming_the_job():
    broker = StubBroker()
    worker = broker.worker("generate")
    client = broker.client()
    job_id = client.submit(_gen())
    assert client.forget(job_id) and not client.forget(job_id)
    worker.reply(worker.take()[0], _result())
    assert client.poll() == []
    lonely = broker.client().submit(_gen())
    with pytest.raises(BrokerUnavailable, match=lonely):
        broker.client().wait(lonely, timeout=0.1)


def test_worker_threads_drain_a_burst_and_join_waits_for_the_last_answer():
    broker = StubBroker()
    stop = threading.Event()

    def serve(worker):
        while not stop.is_set():
            got = worker.take(timeout=0.05)
            if got is not None:
                worker.reply(got[0], _result((int(got[1].prompt_ids[0]),)))

    threads = [threading.Thread(target=serve, args=(broker.worker("generate", capacity=2),)) for _ in range(3)]
    for t in threads:
        t.start()
    try:
        client = broker.client()
        ids = {client.submit(_gen(prompt=(i,))): i for i in range(200)}
        broker.join(timeout=60)
        answers = dict(client.poll())
        assert {rid: int(a.output_ids[0]) for rid, a in answers.items()} == ids
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=T)
    assert broker.stats()["counters"]["answered"] == 200


def test_join_names_what_is_left_when_nobody_answers():
    broker = StubBroker()
    broker.client().submit(_gen())
    with pytest.raises(TimeoutError, match=r"1 job\(s\) still unanswered.*'generate': 1"):
        broker.join(timeout=0.1)


def test_a_job_held_past_its_lease_goes_to_another_worker_and_the_late_reply_is_dropped():
    clock = ManualClock(100.0)
    broker = StubBroker(clock=clock, leases=Leases(per_service={"generate": 2.0}, max_attempts=3))
    slow = broker.worker("generate", capacity=1, worker_id="slow")
    client = broker.client()
    job = client.submit(_gen())
    assert slow.take()[0] == job
    quick = broker.worker("generate", capacity=1, worker_id="quick")
    clock.advance(1.9)
    broker.tick()
    assert quick.take() is None  # still within the lease
    clock.advance(0.2)
    broker.tick()
    assert quick.take()[0] == job  # taken back from slow, given to the other worker first
    assert not slow.reply(job, _result())  # too late: dropped
    assert quick.reply(job, _result())
    assert [rid for rid, _ in client.poll()] == [job]
    assert broker.stats()["counters"]["deadline_requeued"] == 1


def test_a_job_nobody_answers_within_max_attempts_fails_to_its_client_naming_the_lease():
    clock = ManualClock(0.0)
    broker = StubBroker(clock=clock, leases=Leases(default_s=1.0, max_attempts=2))
    worker = broker.worker("reward", capacity=1, worker_id="mute", tasks=["math"])
    client = broker.client()
    job = client.submit(_reward())
    for _ in range(2):
        assert worker.take()[0] == job  # the only worker gets it again after each lease
        clock.advance(1.5)
        broker.tick()
    with pytest.raises(JobFailed, match=r"within its lease of 1s, 2 time\(s\); last worker 'mute'"):
        client.wait(job, timeout=T)
    assert broker.stats()["counters"]["deadline_failed"] == 1 and broker.pool.jobs == {}
    assert worker.take() is None and worker.alive  # its slot is free again


def test_without_leases_a_job_is_held_for_ever():
    clock = ManualClock(0.0)
    broker = StubBroker(clock=clock)
    worker = broker.worker("generate", capacity=1)
    job = broker.client().submit(_gen())
    assert worker.take()[0] == job
    clock.advance(1e6)
    broker.tick()
    assert broker.stats()["counters"].get("deadline_requeued", 0) == 0 and worker.reply(job, _result())
