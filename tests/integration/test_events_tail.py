"""`areal-mq events tail` shows events from several processes, filtered, from files and live from the bus."""
from __future__ import annotations

import json
import subprocess
import sys

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
                             "--event", "echo.job_done", "--json", "--duration", "12", "--keys", cfg.run.run_dir + "/keys"],
                            stdout=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL)
    try:
        import time
        time.sleep(2.5)  # let the live subscriber connect before events flow
        client = JobClient(cfg.brokers.job_addr, keys=keys(cfg, "controller"))
        ids = [client.submit(RewardJob(task="t", completions=["a"]), service="echo") for _ in range(6)]
        got = []
        wait_for(lambda: got.extend(client.poll(0.2)) or len(got) == 6, 30, what="jobs")
        client.close()
        live_out, _ = live.communicate(timeout=30)
    finally:
        if live.poll() is None:
            live.kill()
            live.wait()
    live_records = [json.loads(line) for line in live_out.splitlines() if line.strip()]
    assert len(live_records) == 6 and {r["event"] for r in live_records} == {"echo.job_done"}

    run_dir = cfg.run.run_dir
    every = _tail(run_dir, "--json")
    assert {"broker", "echo"} <= {r["role"] for r in every}
    assert len({(r["role"], r["worker_id"]) for r in every}) >= 3  # three processes wrote events
    done = _tail(run_dir, "--json", "--role", "echo", "--event", "echo.*", "event=echo.job_done")
    assert len(done) == 6 and {r["worker_id"] for r in done} == {"echo-0", "echo-1"}
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
