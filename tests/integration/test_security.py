"""Hostile peers against a real broker process: no key, an unknown key, or a key of the wrong role.

Each case was possible before CURVE (an outside audit did them end to end on loopback): stop a worker
with Control(shutdown), publish WeightsReady with any path, put/take samples, register with capacity
100,000. Now an unkeyed or unknown peer cannot complete the handshake, and a known peer may only say
what its role owns.
Run: pytest tests/integration/test_security.py -q   (~40 s)
"""
from __future__ import annotations

import time
from pathlib import Path

import pytest
import zmq

from areal_mq import protocol
from areal_mq.client import JobClient, SignalPublisher, SignalSubscriber, StoreClient
from areal_mq.errors import BrokerUnavailable, JobFailed
from areal_mq.messages import (Control, Error, Event, GeneratePartial, GenerateRequest, Ready, RewardJob, Sample,
                               SeqSample, WeightsReady)
from areal_mq.security import Keyring, generate_keys

from areal_mq.config import load_config

from .conftest import broker_up, keys, wait_for, worker_count


def _sample(i: int) -> Sample:
    seq = SeqSample(prompt_ids=[1, 2], output_ids=[3], logprobs=[-0.1], versions=[0], reward=1.0)
    return Sample(sample_id=f"s{i}", prompt_id=f"p{i}", seqs=[seq])


@pytest.fixture
def stranger(tmp_path) -> Keyring:
    """A well-formed CURVE identity whose public key is not in the run's key directory."""
    d = tmp_path / "other-keys"
    generate_keys(d, ["controller", "trainer", "broker"])
    return Keyring.load(d, "controller")


def _through_the_bus(pub: SignalPublisher, events: SignalSubscriber) -> bool:
    """Publish a sentinel event after what `pub` sent; True once `events` (subscribed to "events") receives it.
    The bus reads each publisher's messages in order, so everything `pub` sent before has been handled by then
    (a condition to wait on, instead of a sleep; PUB drops what it sends before its link is up)."""
    pub.publish("events", Event(record={"event": "test.sentinel"}))
    while (got := events.recv(0.1)) is not None:
        if got[1].msg.record.get("event") == "test.sentinel":
            return True
    return False


def _with_server_key(stranger: Keyring, cfg) -> Keyring:
    """The stranger knows the brokers' public key (it is public) but its own key is unknown."""
    stranger.key_dir = Path(cfg.run.run_dir) / "keys"
    return stranger


@pytest.fixture
def echo(procs, config_path, cfg, broker):
    proc = procs.start(["worker", "echo", "--config", str(config_path), "--worker-id", "echo-0"], "echo")
    wait_for(lambda: worker_count(cfg, "echo") == 1, 30, what="echo worker")
    return proc


def _identities(cfg, stranger):
    return {"no key": Keyring.insecure("controller"), "unknown key": _with_server_key(stranger, cfg)}


def test_unkeyed_and_unknown_peers_cannot_submit_register_or_put(cfg, echo, stranger):
    for name, ident in _identities(cfg, stranger).items():
        client = JobClient(cfg.brokers.job_addr, keys=ident, heartbeat_s=0.2)
        store = StoreClient(cfg.brokers.store_addr, keys=ident)
        sock = ident.client(zmq.Context.instance().socket(zmq.DEALER))
        sock.linger = 0
        sock.connect(cfg.brokers.job_addr)
        try:
            with pytest.raises(BrokerUnavailable):
                client.wait(client.submit(RewardJob(task="t", completions=["abc"]), service="echo"), 3)
            with pytest.raises(BrokerUnavailable):
                store.put(_sample(1), timeout=2)
            try:
                sock.send_multipart(protocol.encode(Ready(service="generate", capacity=100_000, worker_id="evil")),
                                    zmq.NOBLOCK)
            except zmq.Again:
                pass  # no connection ever came up: nothing can be sent at all
            time.sleep(1.0)
        finally:
            client.close(), store.close(), sock.close(0)
        assert worker_count(cfg, "generate") == 0, name
    observer = StoreClient(cfg.brokers.store_addr, keys=keys(cfg))
    try:
        assert observer.stats()["counters"].get("put", 0) == 0
    finally:
        observer.close()
    logged = "".join(p.read_text() for p in Path(cfg.run.run_dir, "events").glob("broker-*.jsonl"))
    assert "security.peer_refused" in logged  # the unknown key was refused in the handshake, and logged


def test_unkeyed_and_unknown_publishers_cannot_stop_a_worker(cfg, echo, stranger):
    for ident in _identities(cfg, stranger).values():
        pub = SignalPublisher(cfg.brokers.bus_in_addr, keys=ident)
        try:
            for _ in range(10):
                pub.publish("control", Control(action="shutdown", reason="hostile"))
                time.sleep(0.1)
        finally:
            pub.close()
    time.sleep(1.0)
    assert echo.poll() is None, "the echo worker was stopped by an unauthenticated Control"


def test_worker_key_cannot_publish_weights_or_control(cfg, echo):
    rollout = keys(cfg, "rollout")
    sub = SignalSubscriber(cfg.brokers.bus_out_addr, topics=("weights", "control"), keys=keys(cfg))
    events = SignalSubscriber(cfg.brokers.bus_out_addr, topics=("events",), keys=keys(cfg))
    pub = SignalPublisher(cfg.brokers.bus_in_addr, keys=rollout)
    try:
        wait_for(lambda: sub.recv(0.2), 10, what="the retained base WeightsReady")
        inside = str(Path(cfg.run.run_dir, "weights", "v9").resolve())

        def hostile_ones_handled():
            pub.publish("weights", WeightsReady(version=9, path=inside))
            pub.publish("control", Control(action="shutdown", reason="rollout says so"))
            return _through_the_bus(pub, events)

        wait_for(hostile_ones_handled, 30, what="the rollout's publications read by the bus")
        assert sub.recv(1.0) is None  # nothing was forwarded
        assert echo.poll() is None
    finally:
        pub.close(), sub.close(), events.close()
    logged = "".join(p.read_text() for p in Path(cfg.run.run_dir, "events").glob("broker-*.jsonl"))
    assert "bus.refused" in logged and "may not publish:weights" in logged


def test_weights_outside_the_run_are_refused_and_never_retained(cfg, broker):
    pub = SignalPublisher(cfg.brokers.bus_in_addr, keys=keys(cfg, "trainer"))
    events = SignalSubscriber(cfg.brokers.bus_out_addr, topics=("events",), keys=keys(cfg))
    bad_ones = (WeightsReady(version=5, path="/etc"),
                WeightsReady(version=5, path=str(Path(cfg.run.run_dir, "weights", "..", "store").resolve())),
                WeightsReady(version=5, mode="zmq", endpoint="tcp://10.9.9.9:4444"))

    def bad_ones_handled():
        for bad in bad_ones:
            pub.publish("weights", bad)
        return _through_the_bus(pub, events)

    try:
        wait_for(bad_ones_handled, 30, what="the bad WeightsReady read by the bus")
    finally:
        pub.close(), events.close()
    late = SignalSubscriber(cfg.brokers.bus_out_addr, topics=("weights",), keys=keys(cfg))
    try:
        got = wait_for(lambda: late.recv(0.2), 10, what="retained weights")
        assert got[1].msg.mode == "base" and got[1].msg.version == 0
    finally:
        late.close()


def test_roles_may_only_say_what_they_own(cfg, broker):
    rollout_store = StoreClient(cfg.brokers.store_addr, keys=keys(cfg, "rollout"))
    controller_store = StoreClient(cfg.brokers.store_addr, keys=keys(cfg, "controller"))
    try:
        with pytest.raises(JobFailed, match="forbidden"):
            rollout_store.put(_sample(1), timeout=10)
        with pytest.raises(JobFailed, match="forbidden"):
            controller_store.get_batch(1, version=0, wait_s=0.1, timeout=10)
        with pytest.raises(JobFailed, match="forbidden"):
            controller_store.ack("b", ["s1"], timeout=10)
        assert controller_store.put(_sample(2), timeout=10).info["duplicate"] is False
    finally:
        rollout_store.close(), controller_store.close()

    def answer(role: str, msg, service: str = "") -> Error:
        sock = keys(cfg, role).client(zmq.Context.instance().socket(zmq.DEALER))
        sock.linger, sock.rcvtimeo = 0, 10_000
        sock.connect(cfg.brokers.job_addr)
        try:
            sock.send_multipart(protocol.encode(msg, service=service))
            return protocol.decode(sock.recv_multipart()).msg
        finally:
            sock.close(0)

    for role, msg, service in (("reward", Ready(service="generate", capacity=4, worker_id="w"), ""),
                               ("rollout", Ready(service="generate", capacity=100_000, worker_id="w"), ""),
                               ("rollout", RewardJob(task="t", completions=["a"]), "echo"),
                               ("trainer", RewardJob(task="t", completions=["a"]), "reward"),
                               # a pinned request holds the workers' updates: an agent's workflow may not send one
                               ("agent", GenerateRequest(prompt_ids=[1], min_version=1, pin_version=1), ""),
                               # partial tokens of a streamed request: only a rollout worker says those
                               ("agent", GeneratePartial(output_ids=[1], logprobs=[0.0], versions=[0], start=0,
                                                         seq=0), "")):
        got = answer(role, msg, service)
        assert isinstance(got, Error) and got.code == "forbidden", (role, msg.kind, got)
        assert got.message
    assert worker_count(cfg, "generate") == 0


def test_reward_job_naming_code_runs_nothing(procs, tmp_path):
    """The audit's RCE: a RewardJob with task "os:execl" made `areal-mq worker reward` exec a program. A task
    name from the wire selects only a configured task; this one gets bad_request and nothing runs."""
    from .procs import write_config

    path = write_config(tmp_path, {"reward": {"processes": 1, "retries": 0, "tasks": {"arith": {"fn": "arith"}}}})
    cfg = load_config(path)
    procs.start(["broker", "--config", str(path)], "broker")
    broker_up(cfg)
    procs.start(["worker", "reward", "--config", str(path), "--worker-id", "rw-sec"], "reward")
    wait_for(lambda: worker_count(cfg, "reward") == 1, 60, what="reward worker")
    marker = tmp_path / "pwned"
    client = JobClient(cfg.brokers.job_addr, keys=keys(cfg, "controller"), heartbeat_s=cfg.brokers.heartbeat_s)
    try:
        hostile = {  # os.execl(prompt, completion, reference) = exec touch MARKER in the pool process
            "os:execl": RewardJob(task="os:execl", prompt="/usr/bin/touch", completions=["touch"],
                                  reference=str(marker)),
            "a .py path": RewardJob(task=f"{Path(__file__).with_name('reward_fns.py')}:slow", completions=["x"]),
            "a module path": RewardJob(task="areal_mq.rewards.arith_reward:arith_reward", completions=["x"]),
            "a registry name not configured": RewardJob(task="math", completions=["x"]),
        }
        for what, job in hostile.items():
            # refused by the broker (the worker advertises only its configured tasks), else by the worker
            with pytest.raises(JobFailed, match=r"\[no_service\] no worker of service 'reward' serves task|"
                                                r"\[bad_request\] unknown reward task") as err:
                client.wait(client.submit(job, service="reward"), 30)
            assert job.task[:60] in str(err.value), what
        good = client.wait(client.submit(RewardJob(task="arith", completions=["\\boxed{4}"], reference=4),
                                         service="reward"), 30)
        assert good.rewards == [1.0]  # the worker still serves
    finally:
        client.close()
    time.sleep(0.5)
    assert not marker.exists(), "a task name from the wire ran code"
