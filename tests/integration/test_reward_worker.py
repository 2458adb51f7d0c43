"""Reward workers as real processes behind a real broker: scoring, errors as events, kill -9 mid-job
(every job rewarded exactly once), and `areal-mq reward serve` attaching to a running broker.

Run: pytest tests/integration/test_reward_worker.py -q   (~60 s; starts broker and worker processes)
"""
from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
import zmq

from areal_mq import protocol
from areal_mq.client import JobClient
from areal_mq.config import load_config
from areal_mq.errors import JobFailed
from areal_mq.messages import Error, RewardJob, RewardResult

from .conftest import broker_up, wait_for, worker_count
from .procs import keys, write_config

ROOT = str(Path(__file__).resolve().parents[2])
ENV = {"PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
FNS = "tests.integration.reward_fns"
# A job naming a task no worker serves: refused by the broker (workers advertise their configured tasks in
# READY), else by the worker itself; either way with the task's name and nothing run.
REFUSED = r"(\[no_service\] no worker of service 'reward' serves task |\[bad_request\] unknown reward task )"


def _config(tmp_path, log_path, processes=1):
    tasks = {
        "arith": {"fn": "arith"},
        "slow": {"fn": f"{FNS}:slow", "kwargs": {"log_path": str(log_path)}},
        "broken": {"fn": f"{FNS}:broken", "default_reward": -1.0},
    }
    return write_config(tmp_path, {"reward": {"processes": processes, "timeout_s": 20.0, "retries": 0,
                                              "tasks": tasks}})


def _dealer(addr, cfg):
    sock = keys(cfg, "controller").client(zmq.Context.instance().socket(zmq.DEALER))
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(addr)
    return sock


def _collect(sock, want: set[str], timeout: float) -> dict[str, list]:
    """Every answer (duplicates included) until all of `want` are answered and 1 s more has passed."""
    got: dict[str, list] = {}
    deadline = time.monotonic() + timeout
    quiet_until = None
    while time.monotonic() < deadline:
        if quiet_until is None and want <= set(got):
            quiet_until = time.monotonic() + 1.0
        if quiet_until is not None and time.monotonic() > quiet_until:
            break
        if sock.poll(100, zmq.POLLIN):
            env = protocol.decode(sock.recv_multipart())
            if env.kind.value != "heartbeat":
                got.setdefault(env.reply_to or getattr(env.msg, "ref_id", ""), []).append(env.msg)
    return got


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except OSError:
        return False


def test_reward_worker_scores_and_reports_errors(procs, tmp_path):
    path = _config(tmp_path, tmp_path / "slow.log")
    cfg = load_config(path)
    procs.start(["broker", "--config", str(path)], "broker")
    broker_up(cfg)
    procs.start(["worker", "reward", "--config", str(path), "--worker-id", "rw-1"], "reward", env=ENV)
    wait_for(lambda: worker_count(cfg, "reward") == 1, 60, what="reward worker")
    client = JobClient(cfg.brokers.job_addr, keys=keys(cfg, "controller"), heartbeat_s=cfg.brokers.heartbeat_s)
    try:
        ok = client.submit(RewardJob(task="arith", prompt_id="p", completions=[r"\boxed{4}", r"\boxed{4}\boxed{4}"],
                                     reference=4, truncated=[False, False]), service="reward")
        res = client.wait(ok, 60)
        assert isinstance(res, RewardResult) and res.rewards == [1.0, -0.5] and res.worker_id == "rw-1"
        bad = client.submit(RewardJob(task="broken", completions=["x"]), service="reward")
        res = client.wait(bad, 60)
        assert res.rewards == [-1.0] and "RuntimeError: reward service bug" in res.errors[0] and bad in res.errors[0]
        unknown = client.submit(RewardJob(task="nope", completions=["x"]), service="reward")
        with pytest.raises(JobFailed, match=REFUSED + "'nope'") as refused:
            client.wait(unknown, 60)
    finally:
        client.close()
    events = [json.loads(line) for f in (tmp_path / "run" / "events").glob("reward-*.jsonl")
              for line in f.read_text().splitlines()]
    errors = [e for e in events if e.get("event") == "reward.error"]
    assert any(e.get("job") == bad and "RuntimeError" in e.get("error", "") for e in errors), errors
    if "bad_request" in str(refused.value):  # the worker refused it (not the broker): it says so in an event
        assert any(e.get("kind") == "bad_request" and e.get("job") == unknown for e in errors)


def test_kill9_mid_job_every_job_is_rewarded_exactly_once(procs, tmp_path):
    log = tmp_path / "slow.log"
    path = _config(tmp_path, log)
    cfg = load_config(path)
    procs.start(["broker", "--config", str(path)], "broker")
    broker_up(cfg)
    victim = procs.start(["worker", "reward", "--config", str(path), "--worker-id", "victim"], "victim", env=ENV)
    wait_for(lambda: worker_count(cfg, "reward") == 1, 60, what="first reward worker")
    sock = _dealer(cfg.brokers.job_addr, cfg)
    try:
        ids = [f"job-{i}" for i in range(10)]
        for i, job_id in enumerate(ids):
            sock.send_multipart(protocol.encode(RewardJob(task="slow", completions=["x" * (i + 1)]),
                                                id=job_id, service="reward"))
        # the victim alone holds the work: kill it while its pool process is inside a call
        wait_for(lambda: log.exists() and len(log.read_text().splitlines()) >= 2, 60, what="victim mid-job")
        pool_pids = {int(line.split()[2]) for line in log.read_text().splitlines()}
        victim.send_signal(signal.SIGKILL)
        victim.wait(10)
        procs.start(["worker", "reward", "--config", str(path), "--worker-id", "survivor"], "survivor", env=ENV)
        got = _collect(sock, set(ids), timeout=120)
    finally:
        sock.close(0)
    assert set(got) == set(ids), f"unanswered: {set(ids) - set(got)}"
    dupes = {k: len(v) for k, v in got.items() if len(v) != 1}
    assert not dupes, f"answered more than once: {dupes}"
    for i, job_id in enumerate(ids):
        (msg,) = got[job_id]
        assert isinstance(msg, RewardResult) and msg.rewards == [float(i + 1)] and msg.errors == [None]
    assert {m.worker_id for (m,) in got.values()} >= {"survivor"}
    starts = [line.split() for line in log.read_text().splitlines()]
    cut = [c for _, c, pid, _ in starts if int(pid) in pool_pids][-1]  # the call the kill interrupted
    assert any(c == cut and int(pid) not in pool_pids for _, c, pid, _ in starts), "the job was not redone"
    wait_for(lambda: not any(_alive(p) for p in pool_pids), 10, what="the victim's pool processes to die")


def test_reward_serve_attaches_to_a_running_broker(procs, tmp_path):
    path = write_config(tmp_path)
    cfg = load_config(path)
    procs.start(["broker", "--config", str(path)], "broker")
    broker_up(cfg)
    server = procs.start(["reward", "serve", f"{FNS}:length", "--broker", cfg.brokers.job_addr,
                          "--config", str(path), "--processes", "2", "--worker-id", "ext-1"], "serve", env=ENV)
    wait_for(lambda: worker_count(cfg, "reward") == 1, 60, what="reward serve")
    client = JobClient(cfg.brokers.job_addr, keys=keys(cfg, "controller"), heartbeat_s=cfg.brokers.heartbeat_s)
    try:
        ids = [client.submit(RewardJob(task=f"any-{i}", completions=["ab", "abcd"]), service="reward")
               for i in range(4)]
        for job_id in ids:
            res = client.wait(job_id, 60)
            assert res.rewards == [2.0, 4.0] and res.worker_id == "ext-1"
    finally:
        client.close()
    assert procs.stop(server, signal.SIGTERM, timeout=30) == 0


def test_reward_serve_refuses_a_bad_function_clearly(procs, tmp_path):
    path = write_config(tmp_path)
    proc = procs.start(["reward", "serve", "no_such_pkg_zz:score", "--config", str(path)], "bad", env=ENV)
    assert proc.wait(60) == 2
    assert "cannot import module 'no_such_pkg_zz'" in procs.log(proc)
    proc = procs.start(["reward", "serve", "x", "--broker", "localhost:5555", "--config", str(path)], "bad2", env=ENV)
    assert proc.wait(60) == 2
    assert "tcp://HOST:PORT" in procs.log(proc)


def test_reward_serve_with_a_task_scores_that_task_only_and_runs_no_code_a_job_names(procs, tmp_path):
    """The audit's RCE against `areal-mq reward serve FN --task NAME`: a job naming "os:execl" (or an import
    path, a .py file, a built-in) must not make the server load and call it; the job is refused."""
    path = write_config(tmp_path)
    cfg = load_config(path)
    procs.start(["broker", "--config", str(path)], "broker")
    broker_up(cfg)
    procs.start(["reward", "serve", f"{FNS}:length", "--task", "length", "--broker", cfg.brokers.job_addr,
                 "--config", str(path), "--worker-id", "ext-2"], "serve", env=ENV)
    wait_for(lambda: worker_count(cfg, "reward") == 1, 60, what="reward serve")
    marker, payload = tmp_path / "pwned", tmp_path / "payload.sh"
    payload.write_text(f"touch {marker}\n")
    hostile = [  # os.execl(prompt, completion, reference) = /bin/sh payload.sh, in the pool process
        RewardJob(task="os:execl", prompt="/bin/sh", completions=["sh"], reference=str(payload)),
        RewardJob(task=f"{Path(__file__).with_name('reward_fns.py')}:length", completions=["x"]),
        RewardJob(task="areal_mq.rewards.arith_reward:arith_reward", completions=["x"]),
        RewardJob(task="arith", completions=["x"]),
    ]
    client = JobClient(cfg.brokers.job_addr, keys=keys(cfg, "controller"), heartbeat_s=cfg.brokers.heartbeat_s)
    try:
        for job in hostile:
            with pytest.raises(JobFailed, match=REFUSED) as err:
                client.wait(client.submit(job, service="reward"), 30)
            assert job.task[:60] in str(err.value)
        good = client.wait(client.submit(RewardJob(task="length", completions=["abc"]), service="reward"), 30)
        assert good.rewards == [3.0] and good.worker_id == "ext-2"  # still serving
    finally:
        client.close()
    time.sleep(0.5)
    assert not marker.exists(), "a task name from the wire ran code"


def test_reward_serve_finds_the_bus_from_the_broker_address_alone(procs, tmp_path):
    """Issue 13 item 8: `reward serve --broker tcp://H:P` with a config that names no ports (a remote host)
    joins the bus at P+1/P+2 (the layout the brokers bind), not the default ports, and says where it went:
    a Control(shutdown) published on that bus stops it."""
    import yaml

    from areal_mq.client import SignalPublisher
    from areal_mq.messages import Control

    from areal_mq.launch.ports import free_port_block

    job = free_port_block("127.0.0.1", 4)
    path = write_config(tmp_path, {"brokers": {"job_port": job, "bus_in_port": job + 1, "bus_out_port": job + 2,
                                               "store_port": job + 3}})
    cfg = load_config(path)
    remote = tmp_path / "remote.yaml"  # what a reward host has: the run's keys, no broker ports
    remote.write_text(yaml.safe_dump({"run": {"run_dir": str(tmp_path / "elsewhere")},
                                      "security": {"keys_dir": str(tmp_path / "run" / "keys")},
                                      "brokers": {"heartbeat_s": 0.2, "reconnect_max_s": 1.0},
                                      "events": {"console": "json"}}))
    procs.start(["broker", "--config", str(path)], "broker")
    broker_up(cfg)
    server = procs.start(["reward", "serve", f"{FNS}:length", "--broker", f"tcp://127.0.0.1:{job}",
                          "--config", str(remote), "--worker-id", "remote-1"], "serve", env=ENV)
    wait_for(lambda: worker_count(cfg, "reward") == 1, 60, what="reward serve")
    assert f"signal bus tcp://127.0.0.1:{job + 1} (in) / tcp://127.0.0.1:{job + 2} (out)" in procs.log(server)
    pub = SignalPublisher(cfg.brokers.bus_in_addr, keys=keys(cfg, "controller"))
    try:  # PUB drops until the bus link is up: publish until the server has exited
        wait_for(lambda: pub.publish("control", Control(action="shutdown", reason="test done"))
                 or server.poll() is not None, 60, interval=0.5, what="reward serve stopped by Control(shutdown)")
    finally:
        pub.close()
    assert server.poll() == 0, procs.log(server)[-3000:]


def test_control_pause_stops_a_reward_worker_taking_jobs_until_resume(procs, tmp_path):
    """Pause is the role loop's (areal_mq/actor/roles.py PauseControl): READY(0) until Control(resume)."""
    from areal_mq.client import SignalPublisher
    from areal_mq.messages import Control

    path = _config(tmp_path, tmp_path / "calls.log")
    cfg = load_config(path)
    procs.start(["broker", "--config", str(path)], "broker")
    broker_up(cfg)
    worker = procs.start(["worker", "reward", "--config", str(path), "--worker-id", "pausable"], "reward", env=ENV)
    wait_for(lambda: worker_count(cfg, "reward") == 1, 60, what="reward worker")
    client = JobClient(cfg.brokers.job_addr, keys=keys(cfg, "controller"), heartbeat_s=cfg.brokers.heartbeat_s)
    pub = SignalPublisher(cfg.brokers.bus_in_addr, keys=keys(cfg, "controller"))
    try:
        first = client.submit(RewardJob(task="arith", completions=["\\boxed{4}"], reference=4), service="reward")
        assert client.wait(first, 30).rewards == [1.0]  # the bus link is up once a job went through
        # PUB drops until the subscriber's link is up: send until the worker says it paused
        wait_for(lambda: pub.publish("control", Control(action="pause", target_role="reward", reason="test"))
                 or "reward.control" in procs.log(worker), 30, interval=0.5, what="the worker logged reward.control")
        job = client.submit(RewardJob(task="arith", completions=["\\boxed{5}"], reference=5), service="reward")
        assert client.poll(2.0) == [], "a paused worker took a job"
        pub.publish("control", Control(action="resume", target_role="reward", reason="test"))
        assert client.wait(job, 30).rewards == [1.0]
    finally:
        pub.close()
        client.close()
