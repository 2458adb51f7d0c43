"""Rollout workers as real processes (tiny random Llama): bad requests get an Error while the worker keeps
serving; a worker killed mid-batch has its requests finished by another worker, each answered once."""
from __future__ import annotations

import signal

import pytest

from areal_mq.client import JobClient
from areal_mq.messages import Error, GenerateRequest, GenerateResult, SamplingSpec

from .conftest import wait_for, worker_count
from .procs import keys, write_config

pytestmark = pytest.mark.slow


@pytest.fixture
def tiny_config(tmp_path):
    return write_config(tmp_path, {"model": {"name": "tiny-random-llama"}, "rollout": {"engine": {"max_concurrent": 4}},
                                   "launcher": {"threads": {"rollout": 1}}}, name="tiny.yaml")


def _start(procs, path, n):
    for i in range(n):
        procs.start(["worker", "rollout", "--config", str(path), "--worker-id", f"rollout-{i}"], f"rollout{i}")


def test_bad_requests_get_errors_and_the_worker_keeps_serving(procs, tiny_config):
    from areal_mq.config import load_config

    from .conftest import broker_up

    cfg = load_config(tiny_config)
    procs.start(["broker", "--config", str(tiny_config)], "broker")
    broker_up(cfg)
    _start(procs, tiny_config, 1)
    wait_for(lambda: worker_count(cfg, "generate") == 1, 120, interval=0.5, what="rollout worker")
    client = JobClient(cfg.brokers.job_addr, keys=keys(cfg, "controller"))
    try:
        bad = {
            "empty": GenerateRequest(prompt_ids=[], sampling=SamplingSpec(max_new_tokens=4)),
            "too_long": GenerateRequest(prompt_ids=[5] * 4000, sampling=SamplingSpec(max_new_tokens=4)),
            "top_p": GenerateRequest(prompt_ids=[5, 6], sampling=SamplingSpec(top_p=0.0)),
            "vocab": GenerateRequest(prompt_ids=[10**8], sampling=SamplingSpec(max_new_tokens=4)),
        }
        ids = {client.submit(m, service="generate"): name for name, m in bad.items()}
        good = client.submit(GenerateRequest(prompt_ids=[5, 6, 7], sampling=SamplingSpec(max_new_tokens=6, seed=1)),
                             service="generate")
        got = {}
        wait_for(lambda: got.update(client.poll(0.2)) or len(got) == 5, 60, what="five answers")
        for job_id, name in ids.items():
            assert isinstance(got[job_id], Error) and got[job_id].code == "bad_request", name
            assert got[job_id].message
        assert isinstance(got[good], GenerateResult) and len(got[good].output_ids) == 6
    finally:
        client.close()


def test_killed_rollout_worker_requests_finish_elsewhere(procs, tiny_config):
    from areal_mq.config import load_config

    from .conftest import broker_up

    cfg = load_config(tiny_config)
    procs.start(["broker", "--config", str(tiny_config)], "broker")
    broker_up(cfg)
    _start(procs, tiny_config, 2)
    wait_for(lambda: worker_count(cfg, "generate") == 2, 120, interval=0.5, what="two rollout workers")
    client = JobClient(cfg.brokers.job_addr, keys=keys(cfg, "controller"), heartbeat_s=0.2)
    try:
        ids = [client.submit(GenerateRequest(prompt_ids=[5, 6, 7], sampling=SamplingSpec(
            max_new_tokens=400, ignore_eos=True, seed=i)), service="generate") for i in range(8)]

        def busy_worker():
            stats = client.stats(5)["workers"]
            return next((w for w, s in stats.items() if s["in_flight"] == 4), None)

        victim = wait_for(busy_worker, 30, what="a worker holding a full batch")
        pid = next(p.pid for p, path in procs.procs if path.name == f"rollout{victim[-1]}.log")
        procs.stop(next(p for p, _ in procs.procs if p.pid == pid), signal.SIGKILL)
        answers = []
        wait_for(lambda: answers.extend(client.poll(0.5)) or len(answers) >= 8, 300, what="all 8 answers")
        answers.extend(client.poll(1.0))
        assert sorted(a for a, _ in answers) == sorted(ids)  # each exactly once
        assert all(isinstance(m, GenerateResult) and len(m.output_ids) == 400 for _, m in answers)
        assert {m.worker_id for _, m in answers} == {"rollout-0", "rollout-1"} - {victim} or \
            any(m.worker_id != victim for _, m in answers)
    finally:
        client.close()
