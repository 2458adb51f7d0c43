"""The foundation's promises, tested against real broker and worker processes on loopback.

Bad input is answered with Error and the broker keeps serving; a worker killed mid-job has its job done
by another worker exactly once; a killed and restarted broker is rejoined by workers on their own and
serves un-acked samples again; a late joiner gets the retained WeightsReady; full queues refuse.
"""
from __future__ import annotations

import pathlib
import signal

import msgpack
import numpy as np
import pytest
import zmq

from areal_mq import protocol
from areal_mq.client import JobClient, SignalPublisher, SignalSubscriber, StoreClient
from areal_mq.config import load_config
from areal_mq.messages import Error, Ready, RewardJob, RewardResult, Sample, SeqSample, WeightsReady
from areal_mq.actor.runtime import WorkerRuntime

from .conftest import broker_up, wait_for, worker_count
from .procs import keys, write_config


def _raw_dealer(addr, cfg):
    sock = keys(cfg, "controller").client(zmq.Context.instance().socket(zmq.DEALER))
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 5000)
    sock.connect(addr)
    return sock


def _answer(sock):
    """Next non-heartbeat message."""
    while True:
        env = protocol.decode(sock.recv_multipart())
        if env.kind.value != "heartbeat":
            return env


@pytest.fixture
def small_frames(tmp_path):
    return write_config(tmp_path, {"brokers": {"max_frame_mb": 0.01, "max_queue": 2}}, name="small.yaml")


def test_bad_input_gets_an_error_and_the_broker_keeps_serving(procs, small_frames):
    cfg = load_config(small_frames)
    procs.start(["broker", "--config", str(small_frames)], "broker")
    broker_up(cfg)
    procs.start(["worker", "echo", "--config", str(small_frames)], "echo")
    wait_for(lambda: worker_count(cfg, "echo") == 1, 30, what="echo worker")
    good = protocol.encode(RewardJob(task="t", completions=["abc"]), service="echo")
    header = msgpack.unpackb(good[0], raw=False)
    bad_cases = {
        "bad_header": [b"\x00garbage\xff"],
        "bad_version": [msgpack.packb({**header, "v": 99})],
        "unknown_kind": [msgpack.packb({**header, "kind": "frobnicate"})],
        "bad_fields": [msgpack.packb({**header, "body": {"task": 5, "completions": "x"}})],
        "bad_arrays": [msgpack.packb({**header, "arrays": [["int32", [4]]]}), b"\x00" * 8],
        "too_large": protocol.encode(RewardJob(task="t", completions=["a"], meta={"x": np.zeros(5000, np.int32)}),
                                     service="echo"),
    }
    sock = _raw_dealer(cfg.brokers.job_addr, cfg)
    try:
        for code, frames in bad_cases.items():
            sock.send_multipart([bytes(memoryview(f)) for f in frames])
            env = _answer(sock)
            assert isinstance(env.msg, Error), code
            assert env.msg.code == code, (code, env.msg.message)
            assert env.msg.message
        sock.send_multipart([bytes(memoryview(f)) for f in good])
        env = _answer(sock)
        assert isinstance(env.msg, RewardResult) and env.msg.rewards == [3.0]
    finally:
        sock.close(0)
    events = (cfg.run.run_dir + "/events")
    logged = "".join(p.read_text() for p in pathlib.Path(events).glob("broker-*.jsonl"))
    assert logged.count("broker.bad_message") >= len(bad_cases)


def test_full_queue_refuses_with_a_clear_error(procs, small_frames):
    cfg = load_config(small_frames)
    procs.start(["broker", "--config", str(small_frames)], "broker")
    broker_up(cfg)
    client = JobClient(cfg.brokers.job_addr, keys=keys(cfg, "controller"))
    try:
        ids = [client.submit(RewardJob(task="t", completions=["a"]), service="nobody") for _ in range(3)]
        got = wait_for(lambda: client.poll(0.2), 10, what="queue_full error")
        (job_id, msg), = got
        assert job_id == ids[2] and isinstance(msg, Error) and msg.code == "queue_full"
        assert "max_queue 2" in msg.message
    finally:
        client.close()


def test_worker_killed_mid_job_job_completes_once_elsewhere(broker, procs, config_path, cfg):
    env = {"AREAL_ECHO_DELAY_S": "3"}
    workers = {f"echo-{i}": procs.start(["worker", "echo", "--config", str(config_path), "--worker-id", f"echo-{i}"],
                                        f"echo{i}", env) for i in range(2)}
    wait_for(lambda: worker_count(cfg, "echo") == 2, 30, what="two echo workers")
    client = JobClient(cfg.brokers.job_addr, keys=keys(cfg, "controller"), heartbeat_s=0.2)
    try:
        job_id = client.submit(RewardJob(task="t", completions=["abcd"]), service="echo")

        def holder():
            stats = client.stats(5)["workers"]
            return next((w for w, s in stats.items() if s["in_flight"]), None)

        busy = wait_for(holder, 10, what="job dispatched")
        workers[busy].send_signal(signal.SIGKILL)
        answers = []
        wait_for(lambda: answers.extend(client.poll(0.2)) or answers, 30, what="answer after kill")
        answers.extend(client.poll(1.5))  # anything duplicated would arrive here
        assert len(answers) == 1
        rid, msg = answers[0]
        assert rid == job_id and isinstance(msg, RewardResult)
        assert msg.worker_id != busy and msg.rewards == [4.0]
        counters = client.stats(5)["counters"]
        assert counters["answered"] == 1 and counters.get("workers_lost", 0) == 1
    finally:
        client.close()


def _sample(i: int, version: int = 0) -> Sample:
    seq = SeqSample(prompt_ids=[1, 2, 3], output_ids=[4, 5], logprobs=[-0.1, -0.2], versions=[version] * 2,
                    reward=float(i))
    return Sample(sample_id=f"s{i}", prompt_id=f"p{i}", seqs=[seq])


def test_broker_restart_workers_rejoin_and_unacked_samples_return(procs, config_path, cfg):
    broker = procs.start(["broker", "--config", str(config_path)], "broker")
    broker_up(cfg)
    procs.start(["worker", "echo", "--config", str(config_path), "--worker-id", "echo-r"], "echo")
    wait_for(lambda: worker_count(cfg, "echo") == 1, 30, what="echo worker")
    store = StoreClient(cfg.brokers.store_addr, keys=keys(cfg, "controller"))
    trainer = StoreClient(cfg.brokers.store_addr, keys=keys(cfg, "trainer"))
    try:
        for i in range(4):
            assert store.put(_sample(i)).info["duplicate"] is False
        first = trainer.get_batch(2, version=0)
        trainer.ack(first)
        leased = trainer.get_batch(2, version=0)  # served, never acked: the trainer "crashes"
        assert {s.sample_id for s in leased.samples} == {"s2", "s3"}
        procs.stop(broker, signal.SIGKILL)
        procs.start(["broker", "--config", str(config_path)], "broker2")
        broker_up(cfg)
        wait_for(lambda: worker_count(cfg, "echo") == 1, 30, what="worker to re-register by itself")
        assert trainer.get_batch(2, version=0, wait_s=1).samples == []  # leases survive the store's restart
        again = trainer.get_batch(2, version=0, wait_s=2, release_leases=True)  # what a restarted trainer asks
        assert {s.sample_id for s in again.samples} == {"s2", "s3"}
        assert store.put(_sample(0)).info["duplicate"] is True  # acked ids stay known after replay
        trainer.ack(again)
        assert trainer.get_batch(1, version=0, wait_s=0.3).samples == []
        client = JobClient(cfg.brokers.job_addr, keys=keys(cfg, "controller"))
        try:
            msg = client.wait(client.submit(RewardJob(task="t", completions=["xy"]), service="echo"), 15)
            assert msg.rewards == [2.0]
        finally:
            client.close()
    finally:
        store.close()
        trainer.close()


def test_store_drops_stale_samples_with_reason(broker, cfg):
    store = StoreClient(cfg.brokers.store_addr, keys=keys(cfg, "controller"))
    trainer = StoreClient(cfg.brokers.store_addr, keys=keys(cfg, "trainer"))
    try:
        store.put(_sample(1, version=0))
        store.put(_sample(2, version=3))
        batch = trainer.get_batch(1, version=4, max_staleness=2, wait_s=1)
        assert [s.sample_id for s in batch.samples] == ["s2"] and batch.dropped_stale == 1
        stats = store.stats()
        assert stats["counters"]["dropped_stale"] == 1 and stats["drops_by_length"] == {"0-31": 1}
    finally:
        store.close()
        trainer.close()


def _vdir(cfg, name):
    return str(pathlib.Path(cfg.run.run_dir, "weights", name).resolve())


def test_late_joiner_gets_the_retained_weights(broker, cfg):
    pub = SignalPublisher(cfg.brokers.bus_in_addr, keys=keys(cfg, "trainer"))
    early = WorkerRuntime(cfg, role="early", service=None, capacity=1, install_signals=False,
                          keys=keys(cfg, "rollout"))
    late = None
    try:
        assert early.start(wait_weights_s=10).mode == "base"  # nothing published yet: the base model
        for v in (1, 2):
            wait_for(lambda: pub.publish("weights", WeightsReady(version=v, path=_vdir(cfg, f"v{v}"))) or
                     (early.next_signal(0.1) or None), 10, what=f"weights v{v} delivered")
        late = WorkerRuntime(cfg, role="late", service=None, capacity=1, install_signals=False,
                             keys=keys(cfg, "rollout"))
        got = late.start(wait_weights_s=10)
        assert got is not None and got.version == 2 and got.path == _vdir(cfg, "v2")
    finally:
        pub.close()
        early.close()
        if late:
            late.close()


def test_resumed_trainer_announcing_an_older_version_is_followed(broker, cfg):
    pub = SignalPublisher(cfg.brokers.bus_in_addr, keys=keys(cfg, "trainer"))
    early = WorkerRuntime(cfg, role="early", service=None, capacity=1, install_signals=False,
                          keys=keys(cfg, "rollout"))
    late = None
    try:
        early.start(wait_weights_s=10)
        for v, path in ((3, _vdir(cfg, "v3")), (1, _vdir(cfg, "v1"))):
            wait_for(lambda: pub.publish("weights", WeightsReady(version=v, path=path)) or
                     (early.next_signal(0.1) or None), 10, what=f"weights v{v} delivered")
        late = WorkerRuntime(cfg, role="late", service=None, capacity=1, install_signals=False,
                             keys=keys(cfg, "rollout"))
        got = late.start(wait_weights_s=10)
        assert got.version == 1 and got.path == _vdir(cfg, "v1")
    finally:
        pub.close()
        early.close()
        if late:
            late.close()


def test_a_restarted_broker_replays_the_current_weights_not_base(procs, config_path, cfg):
    """After kill -9 of the broker the bus used to replay WeightsReady(v0, "base"): the controller went back to
    v0 and throttled admission, and a worker joining then waited for a version only the next step brings."""
    broker = procs.start(["broker", "--config", str(config_path)], "broker")
    broker_up(cfg)
    pub = SignalPublisher(cfg.brokers.bus_in_addr, keys=keys(cfg, "trainer"))
    sub = SignalSubscriber(cfg.brokers.bus_out_addr, topics=("weights",), keys=keys(cfg))
    try:
        wait_for(lambda: sub.recv(0.2), 10, what="retained base")
        wait_for(lambda: pub.publish("weights", WeightsReady(version=7, path=_vdir(cfg, "v7"))) or
                 ((got := sub.recv(0.2)) and got[1].msg.version == 7), 10, what="v7 delivered")
    finally:
        pub.close(), sub.close()
    procs.stop(broker, signal.SIGKILL)
    procs.start(["broker", "--config", str(config_path)], "broker2")
    broker_up(cfg)
    late = SignalSubscriber(cfg.brokers.bus_out_addr, topics=("weights",), keys=keys(cfg))
    try:
        got = wait_for(lambda: late.recv(0.2), 10, what="retained weights after the restart")
        assert got[1].msg.version == 7 and got[1].msg.mode == "disk"
    finally:
        late.close()


def test_reward_worker_advertises_its_configured_tasks(procs, tmp_path):
    """`areal-mq worker reward` took reward jobs of any task and failed those it has no function for, although
    another worker could have served them; it now lists its tasks in READY and the broker routes by them."""
    path = write_config(tmp_path, {"reward": {"processes": 1, "retries": 0,
                                              "tasks": {"arith": {"fn": "arith"}, "gsm": {"fn": "math"}}}})
    cfg = load_config(path)
    procs.start(["broker", "--config", str(path)], "broker")
    broker_up(cfg)
    procs.start(["worker", "reward", "--config", str(path), "--worker-id", "rw-tasks"], "reward")
    wait_for(lambda: worker_count(cfg, "reward") == 1, 60, what="reward worker")
    client = JobClient(cfg.brokers.job_addr, keys=keys(cfg, "controller"), heartbeat_s=cfg.brokers.heartbeat_s)
    try:
        assert client.stats(5)["workers"]["rw-tasks"]["tasks"] == ["arith", "gsm"]
        refused = client.submit(RewardJob(task="code", completions=["x"]), service="reward")
        (rid, msg), = wait_for(lambda: client.poll(0.1), 5, what="the broker's answer")
        assert rid == refused and isinstance(msg, Error) and msg.code == "no_service" and "'code'" in msg.message
        good = client.wait(client.submit(RewardJob(task="arith", completions=["\\boxed{4}"], reference=4)), 30)
        assert good.rewards == [1.0]
    finally:
        client.close()


def test_a_worker_s_oversized_frame_is_logged_by_the_broker_naming_the_worker(procs, small_frames):
    """ZeroMQ closes a connection that sends a frame over the socket limit without reading it; the broker's
    socket monitor sees the close and names the registered worker that used it (issue 28 item 5h)."""
    cfg = load_config(small_frames)
    procs.start(["broker", "--config", str(small_frames)], "broker")
    broker_up(cfg)
    sock = keys(cfg, "echo").client(zmq.Context.instance().socket(zmq.DEALER))
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(cfg.brokers.job_addr)
    try:
        sock.send_multipart(protocol.encode(Ready(service="echo", capacity=1, worker_id="big-sender")))
        wait_for(lambda: worker_count(cfg, "echo") == 1, 30, what="the worker registered")
        big = int(cfg.brokers.max_frame_mb * 1024 * 1024) + protocol.MAX_HEADER_BYTES + 1
        sock.send_multipart(protocol.encode(RewardResult(rewards=[1.0], worker_id="big-sender"), reply_to="x")
                            + [b"\x00" * big])
        log = pathlib.Path(cfg.run.run_dir, "events")

        def logged():
            return "".join(p.read_text() for p in log.glob("broker-*.jsonl"))

        wait_for(lambda: "broker.worker_connection_closed" in logged(), 30, what="the closed connection logged")
        line = next(x for x in logged().splitlines() if "broker.worker_connection_closed" in x)
        assert "big-sender" in line and "max_frame_mb" in line
    finally:
        sock.close(0)
