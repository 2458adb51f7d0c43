"""Job leases at a real broker (issue 28 item 5f): a worker that holds a job and never answers it, or
answers with a wrong `reply_to`, cannot wedge its client. When the job's lease (brokers.job_deadline_s)
ends, the broker takes it back, frees the worker's slot and gives it to another worker; after
brokers.job_max_attempts leases the client gets Error job_failed. Both long before job_retry_s (600 s).

The silent worker is raw pyzmq in a thread (READY, heartbeats, never a right answer); the good worker is a
real `areal-mq worker echo` process. Run: pytest tests/integration/test_job_deadline.py
"""
from __future__ import annotations

import threading
import time
import uuid
from pathlib import Path

import msgpack
import pytest
import zmq

from areal_mq.client import JobClient
from areal_mq.config import load_config
from areal_mq.errors import JobFailed
from areal_mq.messages import RewardJob, RewardResult

from .conftest import broker_up, wait_for, worker_count
from .procs import keys, write_config


def _pack(kind: str, body: dict, reply_to: str = "") -> list[bytes]:
    return [msgpack.packb({"v": 1, "kind": kind, "id": uuid.uuid4().hex, "reply_to": reply_to, "service": "",
                           "body": body, "arrays": []}, use_bin_type=True)]


class SilentWorker(threading.Thread):
    """Serves `echo` with capacity 1, heartbeats, and never answers a job right: it keeps it (`reply_to`
    None) or answers with a wrong `reply_to` ("" or another id)."""

    def __init__(self, cfg, worker_id: str, reply_to: str | None = None):
        super().__init__(daemon=True)
        self.cfg, self.worker_id, self.reply_to = cfg, worker_id, reply_to
        self.jobs: list[str] = []
        self.stop = threading.Event()

    def run(self) -> None:
        ctx = zmq.Context()
        sock = keys(self.cfg, "echo").client(ctx.socket(zmq.DEALER))
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.cfg.brokers.job_addr)
        ready = _pack("ready", {"service": "echo", "capacity": 1, "worker_id": self.worker_id, "role": "echo"})
        sock.send_multipart(ready)
        beat = time.monotonic()
        try:
            while not self.stop.is_set():
                if time.monotonic() - beat > 0.1:
                    sock.send_multipart(_pack("heartbeat", {"peer_id": self.worker_id}))
                    sock.send_multipart(ready)  # re-announce, as every worker does once per liveness window
                    beat = time.monotonic()
                if sock.poll(50):
                    header = msgpack.unpackb(sock.recv_multipart()[0], raw=False)
                    if header["kind"] == "reward_job":
                        self.jobs.append(header["id"])
                        if self.reply_to is not None:
                            sock.send_multipart(_pack("reward_result", {"rewards": [9.0], "worker_id":
                                                                        self.worker_id}, self.reply_to))
        finally:
            sock.close(0)
            ctx.term()


@pytest.fixture
def leased(tmp_path):
    return write_config(tmp_path, {"brokers": {"job_deadline_s": 2.0, "job_max_attempts": 2}}, name="leased.yaml")


@pytest.fixture
def silent_workers():
    started: list[SilentWorker] = []
    yield started
    for w in started:
        w.stop.set()
        w.join(5)


def _in_flight(client: JobClient, worker_id: str) -> int:
    return client.stats(5)["workers"].get(worker_id, {}).get("in_flight", 0)


def test_a_job_a_worker_never_answers_is_answered_by_another_worker(procs, tmp_path, silent_workers):
    # a 6 s lease: the good worker (a process started once the job sits at the silent one) must register within
    # the first lease; at 2 s a loaded 2-core machine missed it (the job went back to the silent worker, whose
    # second lease then failed it), with this code and the code before it alike
    leased = write_config(tmp_path, {"brokers": {"job_deadline_s": 6.0, "job_max_attempts": 2}}, name="leased.yaml")
    cfg = load_config(leased)
    procs.start(["broker", "--config", str(leased)], "broker")
    broker_up(cfg)
    silent = SilentWorker(cfg, "silent")
    silent_workers.append(silent)
    silent.start()
    wait_for(lambda: worker_count(cfg, "echo") == 1, 30, what="the silent worker registered")
    client = JobClient(cfg.brokers.job_addr, keys=keys(cfg, "controller"), heartbeat_s=0.2)
    try:
        start = time.monotonic()
        job_id = client.submit(RewardJob(task="t", completions=["abcd"]), service="echo")
        wait_for(lambda: silent.jobs, 10, what="the job at the silent worker")
        procs.start(["worker", "echo", "--config", str(leased), "--worker-id", "echo-good"], "echo")
        msg = client.wait(job_id, 60)
        took = time.monotonic() - start
        assert isinstance(msg, RewardResult) and msg.worker_id == "echo-good" and msg.rewards == [4.0]
        assert took < 60, took
        assert silent.jobs == [job_id]  # requeued to the other worker, not back to the silent one
        assert _in_flight(client, "silent") == 0  # its slot was freed
        counters = client.stats(5)["counters"]
        assert counters["deadline_requeued"] == 1 and counters["answered"] == 1
    finally:
        client.close()
    logged = "".join(p.read_text() for p in Path(cfg.run.run_dir, "events").glob("broker-*.jsonl"))
    assert "broker.job_overdue" in logged and '"action": "requeued"' in logged.replace('":"', '": "')


@pytest.mark.parametrize("reply_to", [None, "", "0" * 32])
def test_a_worker_alone_that_never_answers_right_fails_the_job_after_its_attempts(procs, leased, silent_workers,
                                                                                  reply_to):
    cfg = load_config(leased)
    procs.start(["broker", "--config", str(leased)], "broker")
    broker_up(cfg)
    silent = SilentWorker(cfg, "silent", reply_to)
    silent_workers.append(silent)
    silent.start()
    wait_for(lambda: worker_count(cfg, "echo") == 1, 30, what="the silent worker registered")
    client = JobClient(cfg.brokers.job_addr, keys=keys(cfg, "controller"), heartbeat_s=0.2)
    try:
        start = time.monotonic()
        job_id = client.submit(RewardJob(task="t", completions=["abcd"]), service="echo")
        with pytest.raises(JobFailed, match=r"\[job_failed\] no worker answered job .* within its lease of 2s, "
                                            r"2 time\(s\); last worker 'silent'"):
            client.wait(job_id, 60)
        assert time.monotonic() - start < 60
        assert silent.jobs == [job_id, job_id]  # the only worker: tried twice (job_max_attempts)
        assert _in_flight(client, "silent") == 0
        assert client.stats(5)["counters"]["deadline_failed"] == 1
    finally:
        client.close()
