"""docs/protocol.md is enough to write a peer: a raw pyzmq + msgpack reward worker serves a real broker.

The worker (tests/integration/raw_worker.py) imports nothing from areal_mq; it runs as its own process
(`python tests/integration/raw_worker.py ADDR`). Jobs are submitted with the real `JobClient`. A second
check keeps the document honest: every message kind, field and error code in the code appears in it.
"""
from __future__ import annotations

import ast
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import msgpack
import pytest

from areal_mq import protocol
from areal_mq.client import JobClient
from areal_mq.errors import JobFailed
from areal_mq.messages import MESSAGE_TYPES, Error, GenerateRequest, RewardJob, RewardResult, SamplingSpec, SeqSample

from .conftest import broker_up, keys, wait_for

ROOT = Path(__file__).resolve().parents[2]
RAW_WORKER = ROOT / "tests" / "integration" / "raw_worker.py"
DOC = ROOT / "docs" / "protocol.md"


@pytest.fixture
def raw_workers(tmp_path, cfg):
    """Start raw workers as subprocesses; every one is stopped by PID at teardown."""
    started: list[subprocess.Popen] = []

    def start(worker_id: str, *extra: str) -> subprocess.Popen:
        log = open(tmp_path / f"{worker_id}.log", "wb")
        proc = subprocess.Popen([sys.executable, str(RAW_WORKER), cfg.brokers.job_addr, "--worker-id", worker_id,
                                 "--heartbeat-s", str(cfg.brokers.heartbeat_s), "--liveness",
                                 str(cfg.brokers.liveness), "--keys", cfg.run.run_dir + "/keys", *extra],
                                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=ROOT)
        started.append(proc)
        return proc

    yield start
    for proc in started:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)


def broker_stats(cfg) -> dict:
    client = JobClient(cfg.brokers.job_addr, keys=keys(cfg, "controller"), heartbeat_s=cfg.brokers.heartbeat_s)
    try:
        return client.stats(5)
    finally:
        client.close()


def registered(cfg) -> dict:
    return broker_stats(cfg)["workers"]


def test_raw_worker_imports_nothing_from_areal_mq():
    tree = ast.parse(RAW_WORKER.read_text())
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert not any(name.split(".")[0] == "areal_mq" for name in imported), imported
    assert {"zmq", "msgpack"} <= imported


def test_raw_worker_serves_reward_jobs_from_job_client(broker, cfg, raw_workers):
    raw_workers("raw-0")
    wait_for(lambda: "raw-0" in registered(cfg), 30, what="raw worker registered")
    assert registered(cfg)["raw-0"]["service"] == "reward"
    client = JobClient(cfg.brokers.job_addr, keys=keys(cfg, "controller"), heartbeat_s=cfg.brokers.heartbeat_s)
    try:
        jobs = {}
        for i in range(12):
            job = RewardJob(task="exact", prompt_id=f"p{i}", completions=[f" {i} ", f"{i + 1}"], reference=i)
            jobs[client.submit(job)] = i  # no service given: reward_job goes to "reward" by default
        length_id = client.submit(RewardJob(task="length", completions=["abc", "", "hello"]))
        got: dict = {}
        wait_for(lambda: got.update(client.poll(0.1)) or len(got) == len(jobs) + 1, 30, what="13 answers")
        for job_id in jobs:
            msg = got[job_id]
            assert isinstance(msg, RewardResult), msg
            assert msg.rewards == [1.0, 0.0]
            assert msg.worker_id == "raw-0"
            assert msg.details == [{"served_by": "raw-python"}] * 2
        assert got[length_id].rewards == [3.0, 0.0, 5.0]

        bad = client.submit(RewardJob(task="no-such-task", completions=["x"]))
        with pytest.raises(JobFailed, match=r"job_failed.*no-such-task"):
            client.wait(bad, 20)
    finally:
        client.close()


def test_raw_worker_error_reply_reaches_client_as_error(broker, cfg, raw_workers):
    raw_workers("raw-err")
    wait_for(lambda: "raw-err" in registered(cfg), 30, what="raw worker registered")
    client = JobClient(cfg.brokers.job_addr, keys=keys(cfg, "controller"), heartbeat_s=cfg.brokers.heartbeat_s)
    try:
        job_id = client.submit(RewardJob(task="exact", completions=["1"], reference=None, meta={"x": 1}))
        got: dict = {}
        wait_for(lambda: got.update(client.poll(0.1)) or job_id in got, 20, what="an answer")
        assert isinstance(got[job_id], RewardResult) and got[job_id].rewards == [0.0]
        other = client.submit(GenerateRequest(prompt_ids=[1, 2, 3]), service="reward")  # not served by it
        got = {}
        wait_for(lambda: got.update(client.poll(0.1)) or other in got, 20, what="an error answer")
        assert isinstance(got[other], Error) and got[other].code == "bad_request"
        assert got[other].ref_id == other
    finally:
        client.close()


def test_raw_workers_advertising_tasks_get_only_their_tasks(broker, cfg, raw_workers):
    """Routing was by service only: a worker that cannot score a task still got its jobs, and failed them."""
    raw_workers("raw-exact", "--tasks", "exact")
    raw_workers("raw-length", "--tasks", "length")
    wait_for(lambda: {"raw-exact", "raw-length"} <= set(registered(cfg)), 30, what="two raw workers registered")
    assert registered(cfg)["raw-exact"]["tasks"] == ["exact"]
    client = JobClient(cfg.brokers.job_addr, keys=keys(cfg, "controller"), heartbeat_s=cfg.brokers.heartbeat_s)
    try:
        jobs = {client.submit(RewardJob(task=task, completions=["ab"], reference="ab")): task
                for task in ["exact", "length"] * 8}
        got: dict = {}
        wait_for(lambda: got.update(client.poll(0.1)) or len(got) == len(jobs), 30, what="16 answers")
        for job_id, task in jobs.items():
            assert isinstance(got[job_id], RewardResult), got[job_id]
            assert got[job_id].rewards == ([1.0] if task == "exact" else [2.0])
        with pytest.raises(JobFailed, match=r"no_service.*'nope'"):  # nobody serves it: refused at once
            client.wait(client.submit(RewardJob(task="nope", completions=["x"])), 2)
    finally:
        client.close()


def test_heartbeats_keep_raw_worker_registered_and_silence_drops_it(broker, cfg, raw_workers):
    hb, live = cfg.brokers.heartbeat_s, cfg.brokers.liveness
    raw_workers("raw-beating")
    raw_workers("raw-silent", "--heartbeat-s", "0")  # registers, then never heartbeats
    wait_for(lambda: {"raw-beating", "raw-silent"} <= set(registered(cfg)), 30, what="both registered")
    # The silent one is dropped after liveness * heartbeat_s (the control that shows the check can fail) ...
    wait_for(lambda: "raw-silent" not in registered(cfg), hb * live * 10 + 10, what="silent worker dropped")
    # ... while the beating one stays registered for several liveness windows.
    end = time.monotonic() + hb * live * 3
    while time.monotonic() < end:
        assert "raw-beating" in registered(cfg)
        time.sleep(hb)
    stats = broker_stats(cfg)
    assert stats["counters"].get("workers_lost", 0) == 1
    client = JobClient(cfg.brokers.job_addr, keys=keys(cfg, "controller"), heartbeat_s=hb)
    try:
        msg = client.wait(client.submit(RewardJob(task="length", completions=["four"])), 20)
        assert msg.rewards == [4.0] and msg.worker_id == "raw-beating"
    finally:
        client.close()


def test_raw_worker_drains_and_disconnects_on_sigterm(broker, cfg, raw_workers):
    proc = raw_workers("raw-leaving")
    wait_for(lambda: "raw-leaving" in registered(cfg), 30, what="raw worker registered")
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(10) == 0
    wait_for(lambda: "raw-leaving" not in registered(cfg), 10, what="worker removed")
    assert broker_stats(cfg)["counters"].get("workers_lost", 0) == 0  # left by DISCONNECT, not by silence


def test_raw_worker_rejoins_a_restarted_broker(broker, procs, config_path, cfg, raw_workers):
    raw_workers("raw-rejoin")
    wait_for(lambda: "raw-rejoin" in registered(cfg), 30, what="raw worker registered")
    procs.stop(broker, signal.SIGKILL)
    procs.start(["broker", "--config", str(config_path)], "broker2")
    broker_up(cfg)
    # However fast the restart, the worker re-announces itself (READY once per liveness window, §5.4).
    wait_for(lambda: "raw-rejoin" in registered(cfg), 30, what="raw worker re-registered")
    client = JobClient(cfg.brokers.job_addr, keys=keys(cfg, "controller"), heartbeat_s=cfg.brokers.heartbeat_s)
    try:
        assert client.wait(client.submit(RewardJob(task="length", completions=["ab"])), 20).rewards == [2.0]
    finally:
        client.close()


# ---------------------------------------------------------------- the document matches the code
def doc_sections() -> dict[str, str]:
    text = DOC.read_text()
    parts = re.split(r"^### `([a-z_]+)`.*$", text, flags=re.M)
    return {parts[i]: parts[i + 1].split("\n## ")[0] for i in range(1, len(parts), 2)}


def test_protocol_doc_lists_every_kind_and_field():
    sections = doc_sections()
    nested = {"generate_request": SamplingSpec, "sample": SeqSample}
    for kind, cls in MESSAGE_TYPES.items():
        assert kind.value in sections, f"docs/protocol.md has no section for {kind.value}"
        for name in [*cls.model_fields, *(nested[kind.value].model_fields if kind.value in nested else [])]:
            assert name in sections[kind.value], f"{kind.value}.{name} missing from docs/protocol.md"
        assert cls.direction and cls.__doc__
    assert set(sections) == {k.value for k in MESSAGE_TYPES}


def test_protocol_doc_lists_every_error_code_and_header_key():
    text = DOC.read_text()
    codes = re.search(r"codes: ([a-z_, \n]+)\.", Error.__doc__).group(1)
    for code in (c.strip() for c in codes.replace("\n", " ").split(",")):
        assert f"| `{code}` |" in text, f"error code {code} missing from docs/protocol.md §9"
    header = msgpack.unpackb(protocol.encode(RewardJob(task="t", completions=["x"]))[0])
    for key in header:
        assert f"| `{key}` |" in text, f"header key {key} missing from docs/protocol.md §3"
