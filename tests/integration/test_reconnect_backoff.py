"""Reconnect backoff (docs/protocol.md §5.4): start at heartbeat_s, double per failed attempt up to
reconnect_max_s, jittered to 50-100 %. A worker used to log `retry_in_s=1.0` again and again during a broker
outage: the backoff was reset right after each reconnect, before anything had been heard."""
from __future__ import annotations

import random
import time

from areal_mq.client import Backoff, JobClient
from areal_mq.config import load_config
from areal_mq.messages import RewardJob
from areal_mq.actor.runtime import WorkerRuntime
from areal_mq.testing import RecordingLog, wait_for

from .procs import keys, write_config


def test_backoff_doubles_to_the_cap_with_jitter_and_resets():
    b = Backoff(0.5, 4.0, rng=random.Random(7))
    bases, delays = [], []
    for _ in range(6):
        bases.append(b.base)
        delays.append(b.next())
    assert bases == [0.5, 1.0, 2.0, 4.0, 4.0, 4.0]
    assert all(0.5 * base <= d <= base for base, d in zip(bases, delays))
    assert len({round(d, 6) for d in delays[3:]}) == 3  # jittered: peers do not return in lockstep
    b.reset()
    assert b.base == 0.5


def test_worker_backoff_grows_while_the_broker_stays_away(tmp_path):
    path = write_config(tmp_path, {"brokers": {"heartbeat_s": 0.05, "liveness": 2, "reconnect_max_s": 0.4}})
    cfg = load_config(path)  # nothing listens on its job port: the broker is down for the whole test
    log = RecordingLog()
    rt = WorkerRuntime(cfg, role="echo", service="echo", capacity=1, topics=(), log=log, install_signals=False,
                       keys=keys(cfg, "echo"))
    rt.start()
    try:
        lost = lambda: [f for e, f in log.at("warning") if e == "echo.broker_lost"]  # noqa: E731
        wait_for(lambda: len(lost()) >= 6, 15, what="six reconnect attempts")
    finally:
        rt.close(drain_timeout=0)
    retries = [f["retry_in_s"] for f in lost()[:6]]
    assert [f["backoff_s"] for f in lost()[:6]] == [0.05, 0.1, 0.2, 0.4, 0.4, 0.4]
    assert retries[3] > 2 * retries[0], retries  # grows (jitter only takes a delay down to half)
    assert all(r <= 0.4 for r in retries)


def test_job_client_reconnects_less_and_less_often_while_the_broker_stays_away(tmp_path):
    cfg = load_config(write_config(tmp_path))
    client = JobClient(cfg.brokers.job_addr, keys=keys(cfg, "controller"), heartbeat_s=0.05, liveness=2,
                       reconnect_max_s=0.4)
    try:
        client.submit(RewardJob(task="t", completions=["a"]), service="s")
        start = time.monotonic()
        while time.monotonic() - start < 2.5:
            client.poll(0.02)
        # a fixed 0.1 s silence window alone made ~25 reconnects (each resubmitting every pending job)
        assert 2 <= client.reconnects <= 12, client.reconnects
        assert client.link.backoff.base == 0.4
    finally:
        client.close()
