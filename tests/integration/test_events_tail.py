"""`areal-mq events tail` shows events from several processes, filtered, from files and live from the bus."""
from __future__ import annotations

import json
import queue
import subprocess
import sys
import threading
import time

from areal_mq.client import JobClient
from areal_mq.messages import RewardJob

from .conftest import keys, wait_for, worker_count


def _tail(*args, timeout=60):
    out = subprocess.run([sys.executable, "-m", "areal_mq.cli", "events", "tail", *args], capture_output=True,
                         text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    assert out.returncode == 0, out.stderr
    return [json.loads(line) for line in out.stdout.splitlines() if line.strip()]


def test_tail_from_files_and_bus_with_filters(broker, procs, config_path, cfg):
    for i in range(2):
        procs.start(["worker", "echo", "--config", str(config_path), "--worker-id", f"echo-{i}"], f"echo{i}",
                    {"AREAL_ECHO_CAPACITY": "1", "AREAL_ECHO_DELAY_S": "0.05"})
    wait_for(lambda: worker_count(cfg, "echo") == 2, 30, what="echo workers")
    live = subprocess.Popen([sys.executable, "-m", "areal_mq.cli", "events", "tail", "--bus", cfg.brokers.bus_out_addr,
                             "--event", "echo.job_done", "--json", "--duration", "120",
                             "--keys", cfg.run.run_dir + "/keys"],
                            stdout=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL)
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in live.stdout], daemon=True).start()
    live_records: list[dict] = []

    def read_live() -> list[dict]:
        while not lines.empty():
            line = lines.get()
            if line.strip():
                live_records.append(json.loads(line))
        return live_records

    client = JobClient(cfg.brokers.job_addr, keys=keys(cfg, "controller"))
    warmup: list[str] = []

    def one_job_seen_live() -> bool:  # a subscriber sees nothing published before it connected: probe until it does
        job = client.submit(RewardJob(task="t", completions=["a"]), service="echo")
        client.wait(job, 20)
        warmup.append(job)
        deadline = time.monotonic() + 1.0  # its event follows the answer: give it a moment, then probe again
        while not read_live() and time.monotonic() < deadline:
            time.sleep(0.05)
        return bool(live_records)

    try:
        wait_for(one_job_seen_live, 60, interval=0.2, what="the live tail's first event")
        ids = [client.submit(RewardJob(task="t", completions=["a"]), service="echo") for _ in range(6)]
        got = []
        wait_for(lambda: got.extend(client.poll(0.2)) or len(got) == 6, 30, what="jobs")
        wait_for(lambda: set(ids) <= {r["job"] for r in read_live()}, 30, what="the six jobs' events, live")
    finally:
        client.close()
        if live.poll() is None:
            live.terminate()
        live.wait(10)
    assert {r["event"] for r in live_records} == {"echo.job_done"}
    assert {r["job"] for r in live_records} <= set(ids) | set(warmup)  # only what this test submitted, once each
    assert len(live_records) == len({r["job"] for r in live_records})

    run_dir = cfg.run.run_dir
    every = _tail(run_dir, "--json")
    assert {"broker", "echo"} <= {r["role"] for r in every}
    assert len({(r["role"], r["worker_id"]) for r in every}) >= 3  # three processes wrote events
    done = _tail(run_dir, "--json", "--role", "echo", "--event", "echo.*", "event=echo.job_done")
    assert len(done) == 6 + len(warmup) and {r["worker_id"] for r in done} == {"echo-0", "echo-1"}
    only_one = _tail(run_dir, "--json", "worker_id=echo-1", "--event", "echo.job_done")
    assert only_one and all(r["worker_id"] == "echo-1" for r in only_one)
    pretty = subprocess.run([sys.executable, "-m", "areal_mq.cli", "events", "tail", run_dir, "--role", "broker"],
                            capture_output=True, text=True, timeout=60).stdout
    assert "broker.started" in pretty and "echo.job_done" not in pretty


def test_tail_bad_arguments_are_explained(tmp_path):
    out = subprocess.run([sys.executable, "-m", "areal_mq.cli", "events", "tail", str(tmp_path / "nope")],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "no events folder" in out.stderr
    out = subprocess.run([sys.executable, "-m", "areal_mq.cli", "events", "tail", str(tmp_path), "--level", "loud"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "--level" in out.stderr
