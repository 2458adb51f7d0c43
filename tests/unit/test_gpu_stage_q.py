"""benchmarks/gpu/stage_q_quality.py's plan (which worker runs which mode and seeds) and its deadline stop: a
worker's run lives in a session of its own (quality.py starts `areal-mq run` with start_new_session), so the stop
must find it through /proc, not through the worker's process group."""
from __future__ import annotations

import importlib
import subprocess
import sys
import time
from pathlib import Path

import pytest

GPU_BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu"


@pytest.fixture(scope="module")
def stage_q():
    sys.path.insert(0, str(GPU_BENCH))  # report.py then adds benchmarks/ (quality.py)
    try:
        yield importlib.import_module("stage_q_quality")
    finally:
        sys.path.remove(str(GPU_BENCH))


def test_both_runs_of_a_seed_go_side_by_side_and_rounds_follow(stage_q):
    plan = stage_q.assignments(at_once=3, rounds=2, first=10)
    assert plan == [("sync", [10, 13]), ("async_eta2", [10, 13]), ("sync", [11, 14]), ("async_eta2", [11, 14]),
                    ("sync", [12, 15]), ("async_eta2", [12, 15])]
    seeds = [s for _, ws in plan for s in ws]
    assert sorted(set(seeds)) == list(range(10, 16)) and len(seeds) == 12  # every seed twice: once per mode
    with pytest.raises(ValueError, match="must be >= 1"):
        stage_q.assignments(at_once=0, rounds=1, first=0)


@pytest.mark.timeout(60)
def test_the_deadline_stop_reaches_a_run_in_its_own_session(stage_q, tmp_path):
    # a worker that ignores SIGINT and has a child in a new session, as quality.py's `areal-mq run` is
    pid_file = tmp_path / "child.pid"
    code = ("import signal, subprocess, sys, time\n"
            "signal.signal(signal.SIGINT, signal.SIG_IGN)\n"
            "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)'], start_new_session=True)\n"
            f"open({str(pid_file)!r}, 'w').write(str(c.pid))\n"
            "time.sleep(300)\n")
    worker = subprocess.Popen([sys.executable, "-c", code])
    try:
        deadline = time.monotonic() + 30
        while not (pid_file.exists() and pid_file.read_text()) and time.monotonic() < deadline:
            time.sleep(0.1)
        child = int(pid_file.read_text())
        assert child in stage_q.descendants(worker.pid)
        stage_q.stop_workers([worker], wait_s=1.0)
        assert worker.poll() is not None
        deadline = time.monotonic() + 10
        while Path(f"/proc/{child}").exists() and time.monotonic() < deadline:
            state = (Path(f"/proc/{child}") / "stat").read_text().rsplit(")", 1)[1].split()[0]
            if state == "Z":  # killed, waiting for init to reap it
                break
            time.sleep(0.1)
        else:
            assert not Path(f"/proc/{child}").exists()
    finally:
        worker.kill()
