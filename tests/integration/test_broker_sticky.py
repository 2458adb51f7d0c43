"""Sticky routing in the job broker (GenerateRequest.session): turns of a session go to the worker that served
it last while it lives and has credit; a full one is waited for at most sticky_wait_s; a dead one is replaced.

The broker runs in-process on a free loopback port, pumped by hand (test_broker_replies.Harness), so every
step is deterministic; parked jobs expire through `tick()` the way the broker host's loop calls it.
"""
from __future__ import annotations

import time

import pytest

from areal_mq import protocol
from areal_mq.messages import Disconnect, GenerateRequest, GenerateResult, Heartbeat, Ready

from .test_broker_replies import Harness


@pytest.fixture
def make():
    made = []

    def build(**kw):
        made.append(Harness(**kw))
        return made[-1]

    yield build
    for h in made:
        h.close()


def _submit(h, client, session="", prompt=(1, 2, 3)) -> str:
    job_id = protocol.new_id()
    client.send_multipart(protocol.encode(GenerateRequest(prompt_ids=list(prompt), session=session), id=job_id))
    return job_id


def _answer(worker, job_id):
    reply = GenerateResult(output_ids=[7], logprobs=[-0.5], versions=[0], finish_reason="stop")
    worker.send_multipart(protocol.encode(reply, reply_to=job_id))


def _take(h, workers: dict, timeout=2.0) -> tuple[str, str]:
    """(worker name, job id) of the next job any of `workers` receives."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for name, sock in workers.items():
            env = h.recv(sock, 0.02)
            if env is not None:
                return name, env.id
    raise AssertionError("no worker received a job")


def _tick_until(h, cond, timeout=3.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not cond():
        h.pump(0.02)
        h.broker.tick(time.monotonic())
    return cond()


def test_turns_of_a_session_return_to_its_worker_even_when_another_is_freer(make):
    h = make()
    workers = {"A": h.worker("generate", 4, "A"), "B": h.worker("generate", 4, "B")}
    client = h.dealer()
    home = {}
    for s in ("s0", "s1", "s2", "s3"):  # turn 1 of four sessions, in flight together: two on each
        _submit(h, client, s)
        home[s], _ = _take(h, workers)
    assert sorted(home.values()) == ["A", "A", "B", "B"]
    _submit(h, client)  # a session-less job: lands on one of them, making the other the freer
    _take(h, workers)
    for turn in range(2, 4):
        for s in home:
            _submit(h, client, s)
            name, job_id = _take(h, workers)
            assert name == home[s], f"turn {turn} of {s} went to {name}, its KV is on {home[s]}"
            _answer(workers[name], job_id)
    stats = h.broker.stats()
    assert stats["sessions"] == 4 and stats["counters"]["sticky_hits"] == 8


def test_a_session_whose_worker_disconnects_goes_to_another(make):
    h = make()
    workers = {"A": h.worker("generate", 2, "A"), "B": h.worker("generate", 2, "B")}
    client = h.dealer()
    _submit(h, client, "s")
    first, job_id = _take(h, workers)
    _answer(workers[first], job_id)
    h.pump()
    other = "B" if first == "A" else "A"
    workers[first].send_multipart(protocol.encode(Disconnect(reason="test")))
    h.pump()
    assert h.broker.stats()["sessions"] == 0  # a dropped worker's sessions are forgotten
    _submit(h, client, "s")
    assert _take(h, workers)[0] == other


def test_a_session_whose_worker_stops_heartbeating_goes_to_another(make):
    h = make(heartbeat_s=0.1, liveness=3)
    workers = {"A": h.worker("generate", 2, "A"), "B": h.worker("generate", 2, "B")}
    client = h.dealer()
    _submit(h, client, "s")
    first, job_id = _take(h, workers)
    _answer(workers[first], job_id)
    other = "B" if first == "A" else "A"
    alive = workers[other]
    deadline = time.monotonic() + 5.0
    while first in h.broker.stats()["workers"] and time.monotonic() < deadline:
        alive.send_multipart(protocol.encode(Heartbeat(peer_id=other)))
        h.pump(0.05)
        h.broker.tick(time.monotonic())
    assert first not in h.broker.stats()["workers"] and other in h.broker.stats()["workers"]
    _submit(h, client, "s")
    assert _take(h, {other: alive})[0] == other


def _home_full_other_free(h):
    """A serves session "s" and stays full (its turn 1 in flight); B joins afterwards, free."""
    a = h.worker("generate", 1, "A")
    client = h.dealer()
    turn1 = _submit(h, client, "s")
    assert _take(h, {"A": a}) == ("A", turn1)
    b = h.worker("generate", 1, "B")
    return client, a, b, turn1


def test_a_session_whose_worker_is_full_waits_a_bounded_time_then_goes_elsewhere(make):
    """No starvation: the sticky worker never frees its slot, yet the job is served by the other worker."""
    h = make(sticky_wait_s=0.3)
    client, a, b, _ = _home_full_other_free(h)
    start = time.monotonic()
    turn2 = _submit(h, client, "s")
    h.pump(0.1)
    assert h.broker.stats()["sticky_waiting"] == 1  # parked on its worker, though the other is free
    assert _tick_until(h, lambda: h.broker.stats()["sticky_waiting"] == 0)
    assert _take(h, {"A": a, "B": b}) == ("B", turn2)
    assert time.monotonic() - start >= 0.3  # it waited its bound first (a lower bound only: never a speed)
    counters = h.broker.stats()["counters"]
    assert counters["sticky_parked"] == 1 and counters["sticky_expired"] == 1
    _answer(b, turn2)
    turn3 = _submit(h, client, "s")  # the session now lives on B
    assert _take(h, {"A": a, "B": b}) == ("B", turn3)


def test_a_parked_job_takes_its_workers_freed_slot_before_the_wait_ends(make):
    h = make(sticky_wait_s=30.0)
    client, a, b, turn1 = _home_full_other_free(h)
    turn2 = _submit(h, client, "s")
    later = _submit(h, client)  # a session-less job behind it takes the free worker
    assert _take(h, {"A": a, "B": b}) == ("B", later)
    assert h.broker.stats()["sticky_waiting"] == 1
    _answer(a, turn1)
    assert _take(h, {"A": a, "B": b}) == ("A", turn2)
    assert h.broker.stats()["counters"]["sticky_hits"] == 1


def test_when_every_worker_is_full_a_session_job_waits_in_the_queue_not_parked(make):
    h = make(sticky_wait_s=30.0)
    client, a, b, turn1 = _home_full_other_free(h)
    _submit(h, client, "other")
    _take(h, {"B": b})
    turn2 = _submit(h, client, "s")
    h.pump(0.1)
    stats = h.broker.stats()
    assert stats["queued"]["generate"] == 1 and stats["sticky_waiting"] == 0
    _answer(a, turn1)
    assert _take(h, {"A": a, "B": b}) == ("A", turn2)


def test_a_full_session_worker_with_no_wait_falls_back_at_once(make):
    h = make(sticky_wait_s=0.0)
    client, a, b, _ = _home_full_other_free(h)
    turn2 = _submit(h, client, "s")
    assert _take(h, {"A": a, "B": b}) == ("B", turn2)
    assert h.broker.stats()["counters"]["sticky_fallbacks"] == 1


def test_jobs_parked_on_a_worker_that_dies_go_to_another(make):
    h = make(sticky_wait_s=30.0)
    client, a, b, turn1 = _home_full_other_free(h)
    turn2 = _submit(h, client, "s")
    h.pump(0.1)
    assert h.broker.stats()["sticky_waiting"] == 1
    a.send_multipart(protocol.encode(Disconnect(reason="test")))
    assert _take(h, {"B": b}) == ("B", turn1)  # its in-flight job is requeued first
    assert h.broker.stats()["sticky_waiting"] == 0 and h.broker.stats()["queued"]["generate"] == 1
    _answer(b, turn1)
    assert _take(h, {"B": b}) == ("B", turn2)


def test_jobs_parked_on_a_draining_worker_go_to_another_at_once(make):
    h = make(sticky_wait_s=30.0)
    client, a, b, _ = _home_full_other_free(h)
    turn2 = _submit(h, client, "s")
    h.pump(0.1)
    assert h.broker.stats()["sticky_waiting"] == 1
    a.send_multipart(protocol.encode(Ready(service="generate", capacity=0, worker_id="A")))  # drain
    assert _take(h, {"A": a, "B": b}) == ("B", turn2)  # not after the 30 s wait
    assert h.broker.stats()["sticky_waiting"] == 0
