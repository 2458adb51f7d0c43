"""A broker restarted faster than the liveness window (kill -9, started again at once): ZeroMQ reconnects the
peers' sockets by itself and the new broker answers their heartbeats, so no silence gives the restart away.
The boot id in its heartbeat answers does: the client resubmits its unanswered jobs at once and the worker
re-announces at once (docs/protocol.md §5.4). Before, the job waited brokers.job_retry_s (600 s).

Run: pytest tests/integration/test_broker_restart.py -q   (~15 s)
"""
from __future__ import annotations

import signal

from areal_mq.client import JobClient
from areal_mq.config import load_config
from areal_mq.messages import RewardJob

from .conftest import broker_up, wait_for, worker_count
from .procs import keys, write_config

ECHO = {"AREAL_ECHO_SERVICE": "echo"}


def test_a_fast_broker_restart_loses_no_job(procs, tmp_path):
    # liveness window 0.2 s * 150 = 30 s: far longer than the restart, so only the boot id can reveal it
    path = write_config(tmp_path, {"brokers": {"heartbeat_s": 0.2, "liveness": 150, "job_retry_s": 600}})
    cfg = load_config(path)
    broker = procs.start(["broker", "--config", str(path), "--only", "job"], "broker")
    broker_up(cfg)
    client = JobClient(cfg.brokers.job_addr, keys=keys(cfg, "controller"), heartbeat_s=0.2, liveness=150)
    try:
        job = client.submit(RewardJob(task="t", completions=["abc"]), service="echo")  # queued: no worker yet
        wait_for(lambda: client.poll(0.1) == [] and client.link.broker_id, 10, what="a heartbeat answer")
        procs.stop(broker, signal.SIGKILL)
        procs.start(["broker", "--config", str(path), "--only", "job"], "broker2")
        broker_up(cfg)
        procs.start(["worker", "echo", "--config", str(path), "--worker-id", "echo-1"], "echo", env=ECHO)
        got = client.wait(job, 20)  # far less than the liveness window and job_retry_s
        assert got.rewards == [3.0]
        assert client.reconnects == 0, "the socket never went silent: the boot id, not a timeout, found it"
    finally:
        client.close()


def test_a_worker_re_announces_at_once_to_a_restarted_broker(procs, tmp_path):
    path = write_config(tmp_path, {"brokers": {"heartbeat_s": 0.2, "liveness": 150}})
    cfg = load_config(path)
    broker = procs.start(["broker", "--config", str(path), "--only", "job"], "broker")
    broker_up(cfg)
    worker = procs.start(["worker", "echo", "--config", str(path), "--worker-id", "echo-1"], "echo", env=ECHO)
    wait_for(lambda: worker_count(cfg, "echo") == 1, 60, what="the echo worker")
    procs.stop(broker, signal.SIGKILL)
    procs.start(["broker", "--config", str(path), "--only", "job"], "broker2")
    broker_up(cfg)
    # READY again within a few heartbeats, not at the next liveness-th heartbeat (150 * 0.2 s = 30 s)
    wait_for(lambda: worker_count(cfg, "echo") == 1, 10, what="the worker registered with the new broker")
    assert "echo.broker_restarted" in procs.log(worker)


def test_a_slow_start_is_not_a_lost_broker(procs, tmp_path):
    """The liveness clock starts with the first heartbeat, not when the runtime is built: a worker whose model
    load outlasts the liveness window used to log a false broker_lost (and reconnect) right at start."""
    import time

    from areal_mq.actor.runtime import WorkerRuntime
    from areal_mq.testing import RecordingLog

    path = write_config(tmp_path, {"brokers": {"heartbeat_s": 0.1, "liveness": 3}})
    cfg = load_config(path)
    procs.start(["broker", "--config", str(path), "--only", "job"], "broker")
    broker_up(cfg)
    log = RecordingLog()
    rt = WorkerRuntime(cfg, role="echo", service="echo", capacity=1, topics=(), log=log, install_signals=False,
                       keys=keys(cfg, "echo"))
    time.sleep(1.0)  # "loading the model": three times the liveness window
    rt.start()
    rt.ready()
    try:
        wait_for(lambda: worker_count(cfg, "echo") == 1, 10, what="the worker registered")
        time.sleep(0.5)  # an observation window (> liveness 0.3 s): a false broker_lost would show in it
    finally:
        rt.close(drain_timeout=0)
    assert not log.named("echo.broker_lost") and rt.reconnects == 0
