"""The worker link's state machine (areal_mq/actor/link.py) against a bare ROUTER on 127.0.0.1, no broker:
READY, jobs and replies, heartbeats, READY again once per liveness window only while the broker answers, a new
socket (new identity) and READY after silence, a restarted broker (new boot id), no READY after DISCONNECT.

Time is passed in (`beat(now)`) so no test waits for a heartbeat: heartbeat_s is 10 s and `now` jumps ahead."""
from __future__ import annotations

import time

import msgpack
import pytest
import zmq
from structlog.testing import CapturingLogger

from areal_mq import protocol
from areal_mq.actor.link import Job, WorkerLink, advertised_tasks
from areal_mq.config import BrokerConfig
from areal_mq.messages import Error, Heartbeat, Kind, RewardJob

HB = 10.0  # heartbeat_s: far longer than anything the test does in real time


def events(log: CapturingLogger, name: str) -> list[dict]:
    """The fields of every `name` event the link logged."""
    return [c.kwargs for c in log.calls if c.args == (name,)]


@pytest.fixture
def ctx():
    c = zmq.Context()
    yield c
    c.destroy(linger=0)


@pytest.fixture
def router(ctx):
    """The 'broker': a bare ROUTER on a free loopback port."""
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind_to_random_port("tcp://127.0.0.1")
    yield sock
    sock.close(0)


@pytest.fixture
def make_link(ctx, router):
    """make_link(liveness=2, **WorkerLink kwargs) -> (open link to the router, its CapturingLogger); closed at the end."""
    port = int(router.getsockopt_string(zmq.LAST_ENDPOINT).rsplit(":", 1)[1])
    made = []

    def make(liveness=2, **kw):
        brokers = BrokerConfig(job_port=port, heartbeat_s=HB, liveness=liveness, reconnect_max_s=4 * HB)
        log = CapturingLogger()
        link = WorkerLink(ctx, brokers, None, "w-1", role="reward", service="reward", capacity=3, log=log, **kw)
        made.append(link)
        link.open()
        return link, log
    yield make
    for link in made:
        link.close()


def recv(router, timeout=10.0):
    """(peer identity, Envelope) of the next message the 'broker' gets."""
    assert router.poll(int(timeout * 1000)), "the link sent nothing"
    ident, frames = protocol.split_router(router.recv_multipart(copy=False))
    return ident, protocol.decode(frames)


def until_marker(link, router):
    """Kinds the router got from the link's current socket up to a marker heartbeat sent now ('nothing else' is
    checked without waiting: one connection delivers in order). What an old socket sent is left out."""
    link.send(protocol.encode(Heartbeat(peer_id="marker")))
    got = []
    while True:
        ident, env = recv(router)
        if env.kind == Kind.HEARTBEAT and env.msg.peer_id == "marker":
            return [kind for i, kind in got if i == ident]
        got.append((ident, env.kind))


def answer(router, ident, msg, **kw):
    router.send_multipart([ident, *protocol.encode(msg, **kw)])


def received(link, want, timeout=10.0):
    """link.receive() until `want(jobs so far)` holds."""
    jobs, deadline = [], time.monotonic() + timeout
    while not want(jobs):
        assert time.monotonic() < deadline, f"the link received only {jobs}"
        if link.sock.poll(100):
            jobs += link.receive()
    return jobs


def test_ready_job_reply_and_fail(make_link, router):
    link, log = make_link(tasks=["math", "code"])
    assert link.ready()
    ident, env = recv(router)
    assert env.kind == Kind.READY
    assert (env.msg.service, env.msg.capacity, env.msg.worker_id, env.msg.tasks) == \
        ("reward", 3, "w-1", ["code", "math"])
    answer(router, ident, RewardJob(task="math", completions=["4"]), id="j1")
    answer(router, ident, Error(code="forbidden", message="not you"))  # a broker error: logged, not a job
    (job,) = received(link, lambda jobs: jobs and events(log, "reward.broker_error"))
    assert (job.id, type(job.msg)) == ("j1", RewardJob)
    assert link.fail(job, "bad_request", "no grader for math")
    _, env = recv(router)
    assert (env.reply_to, env.msg.code, env.msg.ref_id) == ("j1", "bad_request", "j1")
    assert events(log, "reward.job_failed") == [{"job": "j1", "code": "bad_request", "error": "no grader for math"}]
    link.ready(capacity=0)
    _, env = recv(router)
    assert (env.kind, env.msg.capacity, env.msg.tasks) == (Kind.READY, 0, ["code", "math"])
    assert events(log, "reward.broker_error")[0]["code"] == "forbidden"


def test_an_undecodable_job_with_an_id_is_answered_and_garbage_is_dropped(make_link, router):
    link, log = make_link(event_prefix="swarm")
    link.ready()
    ident, _ = recv(router)
    bad = msgpack.packb({"v": protocol.PROTOCOL_VERSION, "kind": "no_such_kind", "id": "j9", "reply_to": "",
                         "service": "", "body": {}, "arrays": []})
    router.send_multipart([ident, b"\xc1 not msgpack"])
    router.send_multipart([ident, bad])
    deadline = time.monotonic() + 10
    while len(events(log, "swarm.bad_job")) < 2:
        assert time.monotonic() < deadline, log.calls
        if link.sock.poll(100):
            assert link.receive() == []
    _, env = recv(router)  # only the one with an id is answered
    assert (env.kind, env.msg.ref_id, env.msg.code) == (Kind.ERROR, "j9", "unknown_kind")
    assert until_marker(link, router) == []


@pytest.mark.parametrize("liveness, beats, sent", [
    # the second beat ends a window; last heard 10 s ago (< 2 beats): READY again, in case the broker dropped us
    (2, [0, 0.5, 1], [Kind.HEARTBEAT, Kind.HEARTBEAT, Kind.READY]),
    # the third beat ends a window, but nothing was heard for 25 s: a READY now could wait in a dead link's
    # queue and register a ghost later. Not lost yet either (liveness 3 x 10 s)
    (3, [0, 1, 2.5], [Kind.HEARTBEAT] * 3),
])
def test_ready_again_at_a_windows_end_only_while_the_broker_answers(make_link, router, liveness, beats, sent):
    link, log = make_link(liveness=liveness)
    t = time.monotonic()
    link.ready()
    recv(router)
    assert [link.beat(t + k * HB) for k in beats] == [False] * 3  # beat 0.5 is not due: nothing sent
    assert until_marker(link, router) == sent
    assert link.reconnects == 0 and not log.calls


def test_a_silent_broker_gets_a_new_socket_then_ready_and_a_longer_wait(make_link, router):
    rejoined = []
    link, log = make_link(on_rejoin=lambda: rejoined.append(1))
    t = time.monotonic()
    link.ready()
    first, _ = recv(router)
    link.beat(t)
    link.beat(t + HB)
    old = link.sock
    assert link.beat(t + 2.5 * HB) is True  # silent 25 s > liveness 2 x 10 s: lost
    assert link.sock is not old and link.reconnects == 1 and rejoined == [1]
    (lost,) = events(log, "reward.broker_lost")
    assert lost["backoff_s"] == HB and HB / 2 <= lost["retry_in_s"] <= HB
    ident, env = recv(router)
    while env.kind != Kind.READY or ident == first:  # what the old socket had queued may still arrive
        ident, env = recv(router)
    assert env.msg.worker_id == "w-1" and ident != first  # a new identity, announced at once
    # still silent: the reconnect restarted the silence clock (real time, about t); the next loss comes only
    # after liveness (20 s) + the backoff drawn above (5..10 s), and doubles the backoff
    assert link.beat(t + 2.4 * HB) is False
    assert link.beat(t + 3.5 * HB) is True
    assert [f["backoff_s"] for f in events(log, "reward.broker_lost")] == [HB, 2 * HB]


def test_a_restarted_broker_is_rejoined_at_once(make_link, router):
    rejoined = []
    link, log = make_link(on_rejoin=lambda: rejoined.append(1))
    link.ready()
    ident, _ = recv(router)
    answer(router, ident, Heartbeat(peer_id="boot-1"))
    received(link, lambda jobs: link.liveness.broker_id == "boot-1")
    assert rejoined == [] and until_marker(link, router) == []
    answer(router, ident, Heartbeat(peer_id="boot-2"))  # same connection, a new boot id: a restart
    received(link, lambda jobs: rejoined == [1])
    assert until_marker(link, router) == [Kind.READY]
    assert events(log, "reward.broker_restarted") == [{"broker": "boot-2"}] and link.reconnects == 0


def test_no_ready_after_disconnect_nor_before_the_first_ready(make_link, router):
    link, _ = make_link()
    t = time.monotonic()
    link.beat(t)
    assert link.beat(t + 2.5 * HB) is True  # lost before it ever announced: a new socket, no READY
    assert Kind.READY not in until_marker(link, router)
    link.ready()
    assert until_marker(link, router) == [Kind.READY]
    assert link.disconnect("drained")
    assert until_marker(link, router) == [Kind.DISCONNECT]
    assert link.beat(t + 10 * HB) is True
    assert Kind.READY not in until_marker(link, router)


def test_misuse_is_refused_clearly(make_link):
    link, _ = make_link()
    with pytest.raises(RuntimeError, match="already open"):
        link.open()
    link.close()
    link.close()  # idempotent
    with pytest.raises(RuntimeError, match="not open"):
        link.ready()
    with pytest.raises(RuntimeError, match="not open"):
        link.reply(Job("j1", Heartbeat(peer_id="x")), Heartbeat(peer_id="x"))


def test_advertised_tasks():
    assert advertised_tasks(["math", "code", "math"]) == ["code", "math"]
    assert advertised_tasks(["math", "*"]) == []  # '*' serves any task
    assert advertised_tasks([]) == []
    assert advertised_tasks([f"t{i}" for i in range(300)]) == []  # more than READY carries: anything
    assert advertised_tasks(["x" * 200]) == []
