"""The job-futures adapter (areal_mq/actor/job_futures.py) and JobClient.forget, which it stands on.

- JobClient.forget, on a real JobClient against an in-process ROUTER on 127.0.0.1: a forgotten job is never
  resubmitted and its late answer is dropped (also one that wait() had set aside); an unknown id is a no-op;
- JobFutures on the test kit's InMemoryJobs: answers resolve futures (an Error as a value), a deadline fails
  the future with TimeoutError and forgets the job, a cancelled future's job is forgotten before the next poll,
  fail_all fails what still waits, a caller's own future is resolved;
- AsyncJobFutures on an event loop: call() returns the answer, a cancelled call forgets its job, call() before
  start() is a clear error.
Run: pytest tests/unit/test_job_futures.py -q   (~3 s)
"""
from __future__ import annotations

import asyncio
import time
from concurrent.futures import Future

import pytest
import zmq

from areal_mq import protocol
from areal_mq.actor.job_futures import AsyncJobFutures, JobFutures
from areal_mq.client import JobClient
from areal_mq.messages import Ack, Error, Kind, StatsRequest
from areal_mq.testing import InMemoryJobs


# --- JobClient.forget on a real socket --------------------------------------------------------------------------

@pytest.fixture
def router():
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    yield sock, f"tcp://127.0.0.1:{port}"
    sock.close(0)


def received(sock, timeout=0.05) -> list[tuple[bytes, protocol.Envelope]]:
    """The jobs (not heartbeats) that reached the ROUTER within `timeout` seconds."""
    out = []
    while sock.poll(int(timeout * 1000), zmq.POLLIN):
        ident, frames = protocol.split_router(sock.recv_multipart(copy=False))
        env = protocol.decode(frames)
        if env.kind != Kind.HEARTBEAT:
            out.append((ident, env))
        timeout = 0.0
    return out


def reply(sock, ident, job_id):
    sock.send_multipart([ident, *protocol.encode(Ack(ref_id=job_id), reply_to=job_id)])


def pump_until(client, sock, cond, timeout=20.0):
    """Poll the client and the ROUTER until `cond(seen, answers)`: seen = (client identity, job id) for each job
    the ROUTER received, answers = (job id, message) for each answer the client's poll() returned."""
    seen, answers, deadline = [], [], time.monotonic() + timeout
    while not cond(seen, answers):
        assert time.monotonic() < deadline, f"condition not met; the ROUTER saw {seen}, the client got {answers}"
        answers += client.poll(0.02)
        seen += [(ident, env.id) for ident, env in received(sock)]
    return seen, answers


def test_a_forgotten_job_is_never_resubmitted(router):
    sock, address = router
    client = JobClient(address, heartbeat_s=1.0, liveness=60, retry_s=0.1)  # resubmits every 0.1 s
    try:
        kept, dropped = client.submit(StatsRequest()), client.submit(StatsRequest())
        pump_until(client, sock, lambda seen, _: {kept, dropped} <= {job_id for _, job_id in seen})
        assert client.forget(dropped) is True
        assert client.forget(dropped) is False and client.forget("no-such-job") is False
        seen, _ = pump_until(client, sock, lambda seen, _: [j for _, j in seen].count(kept) >= 3)  # resubmitted
        assert dropped not in [job_id for _, job_id in seen]
    finally:
        client.close()


def test_a_late_answer_to_a_forgotten_job_is_dropped(router):
    sock, address = router
    client = JobClient(address, heartbeat_s=1.0, liveness=60)
    try:
        kept, dropped = client.submit(StatsRequest()), client.submit(StatsRequest())
        seen, _ = pump_until(client, sock, lambda seen, _: seen)
        client.forget(dropped)
        reply(sock, seen[0][0], dropped)
        reply(sock, seen[0][0], kept)
        _, answers = pump_until(client, sock, lambda _, answers: any(job_id == kept for job_id, _ in answers))
        assert [job_id for job_id, _ in answers] == [kept]
    finally:
        client.close()


def test_forget_drops_an_answer_that_wait_set_aside(router):
    sock, address = router
    client = JobClient(address, heartbeat_s=1.0, liveness=60)
    try:
        other, waited = client.submit(StatsRequest()), client.submit(StatsRequest())
        seen, _ = pump_until(client, sock, lambda seen, _: seen)
        ident = seen[0][0]
        reply(sock, ident, other)  # arrives while wait() waits for `waited`: set aside for the next poll
        reply(sock, ident, waited)
        assert isinstance(client.wait(waited, timeout=20.0), Ack)
        assert client.forget(other) is True  # answered but not yet handed out
        assert client.poll(0.1) == []
    finally:
        client.close()


# --- JobFutures ---------------------------------------------------------------------------------------------------

def test_answers_resolve_their_futures_and_an_error_is_a_value():
    client = InMemoryJobs()
    jobs = JobFutures(client)
    a, fut_a = jobs.submit(StatsRequest(), "generate")
    b, fut_b = jobs.submit(StatsRequest(), "reward")
    client.answer(b, Error(code="bad_request", message="no"))
    assert jobs.pump() == 1 and fut_b.result(0).code == "bad_request" and not fut_a.done()
    client.answer(a, Ack(ref_id=a))
    client.answer("unknown-job", Ack())  # nobody's: ignored
    jobs.pump()
    assert fut_a.result(0).ref_id == a and len(jobs) == 0


def test_a_passed_deadline_fails_the_future_and_forgets_the_job():
    client = InMemoryJobs()
    jobs = JobFutures(client)
    late, fut_late = jobs.submit(StatsRequest(), "generate", deadline=time.monotonic() - 1.0)
    ok, fut_ok = jobs.submit(StatsRequest(), "generate", deadline=time.monotonic() + 600.0)
    jobs.pump()
    with pytest.raises(TimeoutError, match=late):
        fut_late.result(0)
    assert client.forgotten == [late] and late not in client.pending and not fut_ok.done() and len(jobs) == 1


def test_a_cancelled_future_is_forgotten_before_the_client_polls_again():
    client = InMemoryJobs()
    jobs = JobFutures(client)
    job_id, fut = jobs.submit(StatsRequest(), "generate")
    jobs.pump()
    assert client.polled_pending[-1] == {job_id}
    assert fut.cancel()
    jobs.pump()
    assert client.forgotten == [job_id] and client.polled_pending[-1] == set()  # never resubmitted by that poll
    client.answer(job_id, Ack())  # a late answer: the client dropped it, and so does JobFutures
    assert jobs.pump() == 0 and fut.cancelled()


def test_a_callers_own_future_is_resolved_and_fail_all_fails_the_rest():
    client = InMemoryJobs()
    jobs = JobFutures(client)
    mine: Future = Future()
    job_id, fut = jobs.submit(StatsRequest(), "generate", future=mine)
    assert fut is mine
    _, other = jobs.submit(StatsRequest(), "generate")
    client.answer(job_id, Ack(ref_id=job_id))
    jobs.pump()
    assert mine.result(0).ref_id == job_id
    assert jobs.fail_all(RuntimeError("stopping")) == 1
    with pytest.raises(RuntimeError, match="stopping"):
        other.result(0)
    assert client.pending == {} and len(jobs) == 0


# --- AsyncJobFutures ----------------------------------------------------------------------------------------------

def test_async_call_returns_the_answer_and_a_cancelled_call_forgets_its_job():
    client = InMemoryJobs()

    async def scenario():
        jobs = AsyncJobFutures(lambda: client, poll_s=0.001)
        await jobs.start()
        answered = asyncio.create_task(jobs.call(StatsRequest(), "generate"))
        while not client.pending:
            await asyncio.sleep(0.001)
        (job_id,) = client.pending
        client.answer(job_id, Ack(ref_id=job_id))
        assert (await asyncio.wait_for(answered, 20.0)).ref_id == job_id
        with pytest.raises(asyncio.TimeoutError):  # an episode's timeout cancels its call
            await asyncio.wait_for(jobs.call(StatsRequest(), "reward"), 0.05)
        assert client.pending == {} and len(jobs.jobs) == 0 and client.services[client.forgotten[-1]] == "reward"
        await jobs.close()

    asyncio.run(scenario())
    assert client.closed


def test_async_call_before_start_is_a_clear_error():
    with pytest.raises(RuntimeError, match="before start"):
        asyncio.run(AsyncJobFutures(InMemoryJobs).call(StatsRequest(), "generate"))


def test_a_partial_goes_to_its_callback_and_never_resolves_the_future():
    from areal_mq.messages import GeneratePartial, GenerateResult

    client = InMemoryJobs()
    jobs = JobFutures(client)
    got = []
    job_id, fut = jobs.submit(StatsRequest(), "generate", on_partial=got.append)
    client.answer(job_id, GeneratePartial(output_ids=[7], logprobs=[-0.1], versions=[2], start=0, seq=0))
    jobs.pump()
    assert [p.output_ids.tolist() for p in got] == [[7]] and not fut.done() and job_id in client.pending
    client.answer(job_id, GenerateResult(output_ids=[7], logprobs=[-0.1], versions=[2], finish_reason="stop"))
    jobs.pump()
    assert fut.result(0).finish_reason == "stop" and len(got) == 1 and len(jobs) == 0
