"""The job broker in-process, driven by real DEALER sockets on loopback: what it does with replies, tasks,
READYs, oversized frames, floods of bad input and too many services.

Each test builds a JobBroker on a free port (plaintext: these are routing tests; CURVE is test_security's)
and pumps it by hand, so every step is deterministic: `h.pump()` lets the broker handle what has arrived.
"""
from __future__ import annotations

import math
import time

import msgpack
import numpy as np
import pytest
import zmq

from areal_mq import protocol
from areal_mq.brokers.job_broker import JobBroker, JobState, reply_problem
from areal_mq.messages import (Error, GenerateRequest, GenerateResult, Heartbeat, Kind, Ready, RewardJob,
                               RewardResult, StatsRequest)
from areal_mq.testing import RecordingLog

from .procs import free_ports


class Harness:
    def __init__(self, **kw):
        self.ctx = zmq.Context()
        self.addr = f"tcp://127.0.0.1:{free_ports(1)[0]}"
        self.log = RecordingLog()
        opts = dict(heartbeat_s=1.0, liveness=5, max_queue=100, max_frame_bytes=10_000, log=self.log)
        self.broker = JobBroker(self.ctx, self.addr, **{**opts, **kw})
        self.socks: list[zmq.Socket] = []

    def dealer(self) -> zmq.Socket:
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.addr)
        self.socks.append(sock)
        return sock

    def pump(self, seconds: float = 0.2) -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if self.broker.sock.poll(20, zmq.POLLIN):
                self.broker.handle()

    def recv(self, sock: zmq.Socket, timeout: float = 2.0):
        """Next non-heartbeat message on `sock` (pumping the broker meanwhile), or None."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.pump(0.02)
            if sock.poll(10, zmq.POLLIN):
                env = protocol.decode(sock.recv_multipart())
                if env.kind != Kind.HEARTBEAT:
                    return env
        return None

    def worker(self, service="reward", capacity=1, worker_id="w", tasks=()):
        sock = self.dealer()
        sock.send_multipart(protocol.encode(Ready(service=service, capacity=capacity, worker_id=worker_id,
                                                  tasks=list(tasks))))
        self.pump()
        assert worker_id in self.broker.stats()["workers"], self.log.records[-3:]
        return sock

    def close(self):
        for s in self.socks:
            s.close(0)
        self.broker.close()
        self.ctx.term()


@pytest.fixture
def h():
    harness = Harness()
    yield harness
    harness.close()


def _raw_reply(kind: str, body: dict, reply_to: str) -> list[bytes]:
    return [msgpack.packb({"v": 1, "kind": kind, "id": protocol.new_id(), "reply_to": reply_to, "service": "",
                           "body": body, "arrays": []}, use_bin_type=True)]


def _in_flight(h, worker_id="w") -> int:
    return h.broker.stats()["workers"][worker_id]["in_flight"]


# ---------------------------------------------------------------- item 2: a refused reply still answers the client
@pytest.mark.parametrize("kind, body, words", [
    ("reward_result", {"rewards": "abc"}, "rewards"),
    ("error", {"code": "job_failed"}, "message"),  # an error without its required message
])
def test_a_refused_worker_reply_reaches_the_client_and_frees_the_slot(h, kind, body, words):
    """The broker used to tell only the worker: the client waited forever and the slot stayed taken."""
    worker = h.worker()
    client = h.dealer()
    job_id = protocol.new_id()
    client.send_multipart(protocol.encode(RewardJob(task="t", completions=["a"]), id=job_id))
    assert h.recv(worker).id == job_id
    worker.send_multipart(_raw_reply(kind, body, job_id))
    told = h.recv(worker)
    assert isinstance(told.msg, Error) and told.msg.code == "bad_fields"
    answer = h.recv(client)
    assert answer is not None, "the client never heard of its job"
    assert isinstance(answer.msg, Error) and answer.msg.code == "bad_reply" and answer.reply_to == job_id
    assert answer.msg.ref_id == job_id and "bad_fields" in answer.msg.message and words in answer.msg.message
    assert _in_flight(h) == 0
    nxt = protocol.new_id()
    client.send_multipart(protocol.encode(RewardJob(task="t", completions=["b"]), id=nxt))
    assert h.recv(worker).id == nxt  # the freed slot takes the next job


def test_a_reply_that_fails_to_decode_from_another_worker_fails_nothing(h):
    owner, other = h.worker(worker_id="owner"), h.worker(worker_id="other")
    client = h.dealer()
    job_id = protocol.new_id()
    client.send_multipart(protocol.encode(RewardJob(task="t", completions=["a"]), id=job_id))
    got = h.recv(owner, 0.5) or h.recv(other, 0.5)
    holder, intruder = (owner, other) if _in_flight(h, "owner") else (other, owner)
    assert got.id == job_id
    intruder.send_multipart(_raw_reply("reward_result", {"rewards": "abc"}, job_id))
    assert h.recv(intruder).msg.code == "bad_fields"
    assert h.recv(client, 0.3) is None  # not its job: the holder still owns it
    holder.send_multipart(protocol.encode(RewardResult(rewards=[1.0]), reply_to=job_id))
    assert isinstance(h.recv(client).msg, RewardResult)


# ---------------------------------------------------------------- item 3: replies that make no sense
def _reward_job(n=1):
    return JobState("j", b"c", "reward", [], Kind.REWARD_JOB, "t", n)


def test_reply_problem_names_what_does_not_fit():
    gen = GenerateResult(output_ids=[1, 2], logprobs=[-0.5, -1.0], versions=[0, 0], finish_reason="stop")
    assert "does not answer a reward_job" in reply_problem(_reward_job(), gen)
    assert "3 rewards for 1 completion" in reply_problem(_reward_job(1), RewardResult(rewards=[1.0, 2.0, 3.0]))
    assert "finite" in reply_problem(_reward_job(2), RewardResult(rewards=[1.0, math.nan]))
    assert "finite" in reply_problem(_reward_job(1), RewardResult(rewards=[math.inf]))
    assert reply_problem(_reward_job(2), RewardResult(rewards=[1.0, 0.0])) is None
    assert reply_problem(_reward_job(), Error(code="job_failed", message="x")) is None
    gen_job = JobState("g", b"c", "generate", [], Kind.GENERATE_REQUEST)
    assert reply_problem(gen_job, gen) is None
    assert "does not answer a generate_request" in reply_problem(gen_job, RewardResult(rewards=[1.0]))
    nan = GenerateResult(output_ids=[1], logprobs=[math.nan], versions=[0], finish_reason="stop")
    assert "logprobs must be finite" in reply_problem(gen_job, nan)
    other_job = JobState("o", b"c", "echo", [], Kind.EVENT)  # kinds without a known reply: only the numbers
    assert reply_problem(other_job, RewardResult(rewards=[1.0, 2.0])) is None


BAD_REPLIES = {
    "generate_result for a reward_job": (
        RewardJob(task="t", completions=["a"]),
        GenerateResult(output_ids=[1], logprobs=[-0.1], versions=[0], finish_reason="stop"), "does not answer"),
    "three rewards for one completion": (
        RewardJob(task="t", completions=["a"]), RewardResult(rewards=[1.0, 2.0, 3.0]), "3 rewards for 1"),
    "a NaN reward": (RewardJob(task="t", completions=["a", "b"]), RewardResult(rewards=[1.0, math.nan]), "finite"),
    "NaN logprobs": (
        GenerateRequest(prompt_ids=[1, 2]),
        GenerateResult(output_ids=[1, 2], logprobs=np.array([-0.1, np.nan], np.float32), versions=[0, 0],
                       finish_reason="stop"), "logprobs must be finite"),
}


@pytest.mark.parametrize("case", list(BAD_REPLIES))
def test_a_reply_that_does_not_fit_its_job_is_an_error_to_the_client(h, case):
    job, reply, words = BAD_REPLIES[case]
    service = "generate" if isinstance(job, GenerateRequest) else "reward"
    worker = h.worker(service=service)
    client = h.dealer()
    job_id = protocol.new_id()
    client.send_multipart(protocol.encode(job, id=job_id))
    assert h.recv(worker).id == job_id
    worker.send_multipart(protocol.encode(reply, reply_to=job_id))
    answer = h.recv(client)
    assert isinstance(answer.msg, Error), f"{case}: forwarded as {answer.kind}"
    assert answer.msg.code == "bad_reply" and answer.reply_to == job_id and words in answer.msg.message
    assert "'w'" in answer.msg.message  # names the worker
    told = h.recv(worker)
    assert isinstance(told.msg, Error) and told.msg.code == "bad_reply"
    assert _in_flight(h) == 0 and h.broker.counters["bad_replies"] == 1


# ---------------------------------------------------------------- item 7: routing by task
def test_reward_jobs_go_only_to_workers_serving_their_task(h):
    math_w = h.worker(worker_id="math", tasks=["math"], capacity=5)
    code_w = h.worker(worker_id="code", tasks=["code"], capacity=5)
    client = h.dealer()
    sent = {}
    for i in range(6):
        task = "math" if i % 2 else "code"
        job_id = protocol.new_id()
        sent[job_id] = task
        client.send_multipart(protocol.encode(RewardJob(task=task, completions=["x"]), id=job_id))
    got = {}
    for sock, name in ((math_w, "math"), (code_w, "code")):
        while (env := h.recv(sock, 0.5)) is not None:
            got[env.id] = name
    assert got == sent
    assert h.broker.stats()["workers"]["math"]["tasks"] == ["math"]


def test_a_busy_specialist_does_not_block_jobs_another_worker_serves(h):
    math_w = h.worker(worker_id="math", tasks=["math"])
    code_w = h.worker(worker_id="code", tasks=["code"])
    client = h.dealer()
    ids = [protocol.new_id() for _ in range(3)]
    for job_id, task in zip(ids, ("math", "math", "code")):
        client.send_multipart(protocol.encode(RewardJob(task=task, completions=["x"]), id=job_id))
    assert h.recv(math_w).id == ids[0]
    assert h.recv(code_w).id == ids[2]  # behind a math job that waits for the busy math worker
    assert h.recv(math_w, 0.3) is None  # capacity 1: the second math job waits
    math_w.send_multipart(protocol.encode(RewardResult(rewards=[1.0]), reply_to=ids[0]))
    assert h.recv(math_w).id == ids[1]


def test_a_task_no_registered_worker_serves_is_refused_at_once(h):
    client = h.dealer()
    early = protocol.new_id()  # no reward worker yet: queued as before (workers may still be starting)
    client.send_multipart(protocol.encode(RewardJob(task="code", completions=["x"]), id=early))
    assert h.recv(client, 0.3) is None
    math_w = h.worker(worker_id="math", tasks=["math"])
    assert h.recv(math_w, 0.3) is None  # not its task
    late = protocol.new_id()
    client.send_multipart(protocol.encode(RewardJob(task="code", completions=["x"]), id=late))
    answer = h.recv(client)
    assert isinstance(answer.msg, Error) and answer.msg.code == "no_service" and answer.reply_to == late
    assert "'code'" in answer.msg.message and "math" in answer.msg.message
    anything = h.worker(worker_id="any")  # no tasks: serves any task, the queued job included
    assert h.recv(anything).id == early


def test_a_worker_may_change_its_tasks_with_a_later_ready(h):
    worker = h.worker(tasks=["math"])
    worker.send_multipart(protocol.encode(Ready(service="reward", capacity=1, worker_id="w", tasks=["code"])))
    client = h.dealer()
    job_id = protocol.new_id()
    client.send_multipart(protocol.encode(RewardJob(task="code", completions=["x"]), id=job_id))
    assert h.recv(worker).id == job_id


# ---------------------------------------------------------------- item 12: READY for another service
def test_a_ready_naming_another_service_is_answered(h):
    """It used to be silently ignored: the worker believed it served 'generate' and got reward jobs."""
    worker = h.worker(service="reward")
    ready = protocol.encode(Ready(service="other", capacity=3, worker_id="w"))
    worker.send_multipart(ready)
    answer = h.recv(worker)
    assert isinstance(answer.msg, Error) and answer.msg.code == "bad_request"
    assert "'reward'" in answer.msg.message and "new socket" in answer.msg.message
    assert h.broker.stats()["workers"]["w"] == {"service": "reward", "capacity": 1, "in_flight": 0, "tasks": []}


def test_a_second_live_registration_of_one_worker_id_is_refused_naming_it(h):
    """Two registrations with one worker_id used to merge silently (stats showed one of them)."""
    h.worker(service="reward", worker_id="twin")
    other = h.dealer()
    other.send_multipart(protocol.encode(Ready(service="reward", capacity=2, worker_id="twin")))
    answer = h.recv(other)
    assert isinstance(answer.msg, Error) and answer.msg.code == "bad_request"
    assert "worker_id 'twin' is already registered" in answer.msg.message and "unique" in answer.msg.message
    assert len(h.broker.workers) == 1 and h.broker.counters["duplicate_worker_ids"] == 1


def test_a_worker_id_registering_again_after_its_old_connection_went_silent_replaces_it(h):
    """A worker that reconnects on a new socket keeps its worker_id: the silent old registration goes."""
    old = h.worker(service="reward", worker_id="again")
    client = h.dealer()
    client.send_multipart(protocol.encode(RewardJob(task="t", completions=["a"]), service="reward"))
    job = h.recv(old)
    assert job.kind == Kind.REWARD_JOB
    for w in h.broker.workers.values():
        w.last_seen -= 3 * h.broker.heartbeat_s  # silent for 3 heartbeats
    new = h.dealer()
    new.send_multipart(protocol.encode(Ready(service="reward", capacity=1, worker_id="again")))
    again = h.recv(new)
    assert again.kind == Kind.REWARD_JOB and again.id == job.id  # its job requeued to the new connection
    assert len(h.broker.workers) == 1 and h.broker.counters.get("duplicate_worker_ids", 0) == 0


def test_an_empty_message_is_a_bad_header_and_a_req_socket_hears_nothing(h):
    client = h.dealer()
    client.send(b"")
    answer = h.recv(client)
    assert answer.msg.code == "bad_header"
    req = h.ctx.socket(zmq.REQ)
    req.setsockopt(zmq.LINGER, 0)
    req.connect(h.addr)
    h.socks.append(req)
    req.send_multipart(protocol.encode(StatsRequest()))
    h.pump(0.5)
    assert not req.poll(200, zmq.POLLIN)  # the broker answered bad_header, without the REQ's empty frame
    assert h.broker.counters["refused"] == 2


# ---------------------------------------------------------------- item 10: oversized frames dropped at the socket
def _monitor_disconnects(ctx, sock):
    mon_addr = f"inproc://mon-{id(sock)}"
    sock.monitor(mon_addr, zmq.EVENT_DISCONNECTED)
    mon = ctx.socket(zmq.PAIR)
    mon.setsockopt(zmq.LINGER, 0)
    mon.connect(mon_addr)
    return mon


def test_a_frame_over_the_socket_limit_is_dropped_not_received(h):
    """It was read whole (a 600 MiB frame: 681 MB RSS) and then refused with too_large."""
    client = h.dealer()
    mon = _monitor_disconnects(h.ctx, client)
    try:
        client.send_multipart(protocol.encode(Heartbeat()))  # connected
        assert h.recv(client, 1.0) is None  # (heartbeat answers are skipped by recv)
        limit = h.broker.max_frame_bytes + protocol.MAX_HEADER_BYTES
        header = msgpack.packb({"v": 1, "kind": "reward_job", "id": "big", "service": "s",
                                "body": {"task": "t", "completions": ["a"]}, "arrays": [["uint8", [limit + 1]]]})
        client.send_multipart([header, b"\x00" * (limit + 1)])
        answer = h.recv(client, 1.5)
        assert answer is None, f"the oversized message was received and answered: {answer.msg}"
        assert mon.poll(2000, zmq.POLLIN), "the broker kept the connection"
        assert h.broker.counters.get("accepted", 0) == 0
        client.send_multipart(protocol.encode(StatsRequest()))  # the socket reconnected by itself
        assert h.recv(client, 5.0).kind == Kind.STATS
    finally:
        client.disable_monitor()
        mon.close(0)


def test_a_frame_under_the_socket_limit_is_still_refused_with_too_large(h):
    client = h.dealer()
    frames = protocol.encode(RewardJob(task="t", completions=["a"], meta={"x": np.zeros(5000, np.int32)}),
                             service="s")
    client.send_multipart(frames)
    assert h.recv(client).msg.code == "too_large"


# ---------------------------------------------------------------- item 11: floods of bad input
def test_a_flood_of_bad_frames_is_answered_but_logged_once_per_peer_and_reason(h):
    """10,000 garbage frames used to write 10,041 warning lines."""
    flooder, other = h.dealer(), h.dealer()
    for _ in range(2000):
        flooder.send(b"\x00garbage\xff")
    other.send(b"\x00garbage\xff")
    other.send_multipart([msgpack.packb({"v": 9, "kind": "heartbeat", "id": "x"})])
    answers = 0
    deadline = time.monotonic() + 20
    while answers < 2000 and time.monotonic() < deadline:
        h.pump(0.05)
        while flooder.poll(0, zmq.POLLIN):
            answers += protocol.decode(flooder.recv_multipart()).msg.code == "bad_header"
    assert answers == 2000  # every bad frame is still answered
    h.pump(0.2)
    lines = h.log.named("broker.bad_message")
    assert len(lines) == 3, lines  # flooder/bad_header, other/bad_header, other/bad_version
    assert {(f["peer"] == lines[0]["peer"], f["code"]) for f in lines} == {
        (True, "bad_header"), (False, "bad_header"), (False, "bad_version")}
    h.broker.refusals.every_s = 0.0  # next interval: the suppressed count rides along
    flooder.send(b"\x00garbage\xff")
    h.pump(0.2)
    assert h.log.named("broker.bad_message")[-1]["suppressed"] == 1999


# ---------------------------------------------------------------- item 18: bounded number of services
def test_services_are_bounded_and_forgotten_when_unused():
    h = Harness(max_services=2)
    try:
        worker = h.worker(service="x", worker_id="wx")
        client = h.dealer()
        client.send_multipart(protocol.encode(RewardJob(task="t", completions=["a"]), service="q1"))
        assert h.recv(client, 0.3) is None  # queued: 2 services now
        refused = protocol.new_id()
        client.send_multipart(protocol.encode(RewardJob(task="t", completions=["a"]), service="q2", id=refused))
        answer = h.recv(client)
        assert answer.msg.code == "no_service" and "max_services (2)" in answer.msg.message
        late = h.dealer()
        late.send_multipart(protocol.encode(Ready(service="q3", capacity=1, worker_id="w3")))
        assert h.recv(late).msg.code == "no_service"
        assert "w3" not in h.broker.stats()["workers"]
        worker.send_multipart(protocol.encode(Ready(service="x", capacity=1, worker_id="wx")))  # re-READY: fine
        assert h.recv(worker, 0.3) is None
        from areal_mq.messages import Disconnect
        worker.send_multipart(protocol.encode(Disconnect(reason="done")))
        h.pump()
        assert set(h.broker.stats()["queued"]) == {"q1"}  # "x" has no worker and no job: forgotten
        client.send_multipart(protocol.encode(RewardJob(task="t", completions=["a"]), service="q2"))
        assert h.recv(client, 0.3) is None  # room again: queued
        assert h.broker.stats()["queued"] == {"q1": 1, "q2": 1}
    finally:
        h.close()
