"""Issue 40, part 3: the four findings of the protocol audit, each pinned by a test (recovery and logging).

(a) a worker whose connection the broker closed (a frame over the socket limit) sends READY again at once and
    is registered, not refused as "already registered by another live connection";
(b) `security.peer_refused` is rate-limited per socket and reason, and every line names its socket;
(c) a job's `broker.job_overdue` lines for a requeue and for its final failure do not share a rate-limit key;
(d) a refused duplicate READY writes `broker.duplicate_worker_id`, and a replaced registration counts in
    `workers_replaced`, not `workers_lost`.

The job broker runs in process (the Harness of test_broker_replies: deterministic pumping), except the
end-to-end check of (a) against a real `areal-mq broker` process. Run: pytest tests/integration/test_fault_audit.py
"""
from __future__ import annotations

import json
import pathlib
import time

import msgpack
import pytest
import zmq

from areal_mq import protocol
from areal_mq.brokers.dispatch import Leases
from areal_mq.config import load_config
from areal_mq.messages import Error, Kind, Ready, RewardJob, RewardResult
from areal_mq.security import AllowList, HandshakeWatch, ZapHandler, generate_keys, zap_domain
from areal_mq.testing import RecordingLog

from .conftest import broker_up, wait_for, worker_count
from .procs import keys, write_config
from .test_broker_replies import Harness, _monitor_disconnects


@pytest.fixture
def h():
    harness = Harness(heartbeat_s=30.0)  # nothing here may end a registration by silence during a test
    yield harness
    harness.close()


def _oversized(h: Harness) -> list[bytes]:
    limit = h.broker.max_frame_bytes + protocol.MAX_HEADER_BYTES
    header = msgpack.packb({"v": 1, "kind": "reward_result", "id": "big", "reply_to": "x",
                            "body": {"rewards": [1.0], "worker_id": "w"}, "arrays": [["uint8", [limit + 1]]]})
    return [header, b"\x00" * (limit + 1)]


# ---------------------------------------------------------------- (a)
def test_a_worker_whose_connection_closed_registers_again_at_once_and_gets_its_job_back(h):
    """The close event waits in the monitor while the READY is handled first (only the job socket is pumped
    here, as in a poll loop that serves the job socket before the monitor): the READY drains it itself."""
    watch = HandshakeWatch(h.broker.sock, h.log, h.addr, h.broker.connection_closed)
    h.broker.poll_closed = watch.handle
    worker = h.worker(service="reward", worker_id="big-sender")
    client = h.dealer()
    client.send_multipart(protocol.encode(RewardJob(task="t", completions=["a"]), service="reward"))
    job = h.recv(worker)
    assert job.kind == Kind.REWARD_JOB
    old_ident = next(iter(h.broker.workers))
    mon = _monitor_disconnects(h.ctx, worker)
    try:
        worker.send_multipart(_oversized(h))
        h.pump(0.3)
        assert mon.poll(5000, zmq.POLLIN), "the broker kept the oversized sender's connection"
        worker.send_multipart(protocol.encode(Ready(service="reward", capacity=1, worker_id="big-sender")))
        again = h.recv(worker, 5.0)
        assert again is not None and not isinstance(again.msg, Error), again and again.msg
        assert again.kind == Kind.REWARD_JOB and again.id == job.id  # its job came back on the new connection
        assert list(h.broker.stats()["workers"]) == ["big-sender"] and old_ident not in h.broker.workers
        counters = h.broker.counters
        assert counters["workers_lost"] == 1 and counters["requeued"] == 1
        assert counters.get("duplicate_worker_ids", 0) == 0 and counters.get("workers_replaced", 0) == 0
        (removed,) = h.log.named("broker.worker_removed")
        assert removed["reason"] == "connection closed" and removed["requeued"] == 1
        (closed,) = h.log.named("broker.worker_connection_closed")
        assert closed["worker"] == "big-sender" and "READY again" in closed["hint"]
    finally:
        worker.disable_monitor()
        mon.close(0)
        watch.close()


def test_end_to_end_a_re_ready_right_after_an_oversized_frame_is_never_refused(procs, tmp_path):
    """A real broker process; heartbeats of 5 s, so only the closed connection can end the old registration
    before the re-READY (the old code answered it bad_request "already registered by another live
    connection" for 2 heartbeats). No answer at all may be an error."""
    path = write_config(tmp_path, {"brokers": {"max_frame_mb": 0.01, "heartbeat_s": 5.0}}, name="big.yaml")
    cfg = load_config(path)
    procs.start(["broker", "--config", str(path)], "broker")
    broker_up(cfg)
    sock = keys(cfg, "echo").client(zmq.Context.instance().socket(zmq.DEALER))
    sock.setsockopt(zmq.LINGER, 0)
    mon = _monitor_disconnects(zmq.Context.instance(), sock)
    sock.connect(cfg.brokers.job_addr)
    ready = protocol.encode(Ready(service="echo", capacity=1, worker_id="big-sender"))
    try:
        sock.send_multipart(ready)
        wait_for(lambda: worker_count(cfg, "echo") == 1, 30, what="the worker registered")
        big = int(cfg.brokers.max_frame_mb * 1024 * 1024) + protocol.MAX_HEADER_BYTES + 1
        sock.send_multipart(protocol.encode(RewardResult(rewards=[1.0], worker_id="big-sender"), reply_to="x")
                            + [b"\x00" * big])
        assert mon.poll(20_000, zmq.POLLIN), "the broker kept the oversized sender's connection"
        sock.send_multipart(ready)  # at once, as docs/protocol.md §10 says
        answers = []

        def registered_again() -> bool:
            while sock.poll(0, zmq.POLLIN):
                env = protocol.decode(sock.recv_multipart())
                if env.kind != Kind.HEARTBEAT:
                    answers.append(env.msg)
            assert not answers, f"the re-READY was answered: {answers}"
            counters = _stats(cfg)["counters"]
            return counters.get("workers_lost", 0) == 1 and "big-sender" in _stats(cfg)["workers"]

        wait_for(registered_again, 30, interval=0.2, what="the old registration ended and the new one accepted")
        time.sleep(0.5)
        assert registered_again() and _stats(cfg)["counters"].get("duplicate_worker_ids", 0) == 0
    finally:
        sock.disable_monitor()
        mon.close(0)
        sock.close(0)


def _stats(cfg) -> dict:
    from areal_mq.client import JobClient

    client = JobClient(cfg.brokers.job_addr, keys=keys(cfg))
    try:
        return client.stats(10)
    finally:
        client.close()


# ---------------------------------------------------------------- (b)
def _zap_request(domain: bytes, address: bytes = b"127.0.0.1") -> list[bytes]:
    return [b"1.0", b"1", domain, address, b"", b"CURVE", b"\x07" * 32]  # a key no directory lists


def test_unknown_key_refusals_are_rate_limited_per_socket_and_reason_and_name_their_socket(tmp_path):
    """They were keyed by the peer's address across all sockets: a refusal at a second socket showed up only
    as `suppressed: 1` in a later line, naming no socket."""
    generate_keys(tmp_path / "keys", ["broker"])
    log, ctx = RecordingLog(), zmq.Context()
    zap = ZapHandler(ctx, AllowList(tmp_path / "keys"), log)
    try:
        job, store = "tcp://127.0.0.1:5555", "tcp://127.0.0.1:5558"
        for domain in (zap_domain(job), zap_domain(store), zap_domain(job)):
            assert zap._answer(_zap_request(domain))[2] == b"400"
        lines = log.named("security.peer_refused")
        assert [(x["socket"], x["reason"], x["suppressed"]) for x in lines] == [
            (job, "unknown_key", 0), (store, "unknown_key", 0)]  # the second job refusal: suppressed
        zap.log.every_s = 0.0  # the next interval: the summary names its socket and carries the count
        zap._answer(_zap_request(zap_domain(job)))
        assert (log.named("security.peer_refused")[-1]["socket"], log.named("security.peer_refused")[-1]
                ["suppressed"]) == (job, 1)
    finally:
        zap.close()
        ctx.term()


def test_the_broker_s_sockets_each_log_an_unknown_key_with_their_own_address(cfg, broker, tmp_path):
    """A real broker process: one stranger's key knocks at the job broker, then at the sample store (same
    address, within 10 s): two lines, one per socket."""
    generate_keys(tmp_path / "other", ["broker", "controller"])
    stranger = keys(cfg, "controller").load(tmp_path / "other", "controller")
    server_key = keys(cfg, "controller").server_key("broker")
    events = pathlib.Path(cfg.run.run_dir, "events")

    def refused_at() -> set[str]:
        return {rec.get("socket") for p in events.glob("broker-*.jsonl") for rec in map(json.loads,
                p.read_text().splitlines()) if rec.get("event") == "security.peer_refused"
                and rec.get("reason") == "unknown_key"}

    for addr in (cfg.brokers.job_addr, cfg.brokers.store_addr):
        sock = stranger.client(zmq.Context.instance().socket(zmq.DEALER))
        sock.curve_serverkey = server_key
        sock.linger = 0
        sock.connect(addr)
        try:
            wait_for(lambda: addr in refused_at(), 30, interval=0.1, what=f"the refusal at {addr} logged")
        finally:
            sock.close(0)
    assert {cfg.brokers.job_addr, cfg.brokers.store_addr} <= refused_at()


# ---------------------------------------------------------------- (c)
def test_a_job_s_final_overdue_failure_is_logged_even_right_after_its_requeue():
    """Both lines used to share one key per worker: with short leases the failure line never appeared."""
    h = Harness(heartbeat_s=30.0, leases=Leases(0.2, {}, 2))
    try:
        h.worker(service="reward", worker_id="mute")  # takes jobs, never answers
        client = h.dealer()
        job_id = protocol.new_id()
        client.send_multipart(protocol.encode(RewardJob(task="t", completions=["a"]), service="reward", id=job_id))
        deadline = time.monotonic() + 15
        answer = None
        while answer is None and time.monotonic() < deadline:
            h.pump(0.05)
            h.broker.tick(time.monotonic())
            if client.poll(0, zmq.POLLIN):
                env = protocol.decode(client.recv_multipart())
                answer = env if env.kind != Kind.HEARTBEAT else None
        assert answer is not None and answer.msg.code == "job_failed" and answer.reply_to == job_id
        actions = [x["action"] for x in h.log.named("broker.job_overdue")]
        assert actions == ["requeued", "failed"], actions
    finally:
        h.close()


# ---------------------------------------------------------------- (d)
def test_a_refused_duplicate_ready_is_logged_and_a_replaced_registration_is_not_a_lost_worker(h):
    h.worker(service="reward", worker_id="twin")
    other = h.dealer()
    other.send_multipart(protocol.encode(Ready(service="reward", capacity=2, worker_id="twin")))
    answer = h.recv(other)
    assert answer.msg.code == "bad_request" and "send READY again" in answer.msg.message
    (line,) = h.log.named("broker.duplicate_worker_id")
    assert line["worker"] == "twin" and line["service"] == "reward" and "unique" in line["hint"]
    for w in h.broker.workers.values():
        w.last_seen -= 3 * h.broker.heartbeat_s  # the first connection went silent: the id is taken over
    other.send_multipart(protocol.encode(Ready(service="reward", capacity=2, worker_id="twin")))
    h.pump()
    assert h.broker.stats()["workers"]["twin"]["capacity"] == 2
    counters = h.broker.counters
    assert counters["workers_replaced"] == 1 and counters.get("workers_lost", 0) == 0
    assert h.log.named("broker.worker_removed")[-1]["reason"].startswith("replaced")
