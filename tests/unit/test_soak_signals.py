"""The soak's nemesis signals a role's process that may be gone by then (benchmarks/soak.py): the first 60-minute
soak ended at minute 46 on a ProcessLookupError when a role's process exited between the lookup and the kill."""
from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import soak  # noqa: E402


def test_a_process_gone_before_the_signal_is_looked_up_again_not_raised(tmp_path):
    gone = subprocess.Popen(["sleep", "0"])
    gone.wait()
    assert soak._signal_role(tmp_path, "trainer", gone.pid, signal.SIGKILL, tries=1) is None  # no new one: None


def test_a_live_process_gets_the_signal(tmp_path):
    live = subprocess.Popen(["sleep", "30"])
    try:
        assert soak._signal_role(tmp_path, "trainer", live.pid, signal.SIGKILL, tries=1) == live.pid
        assert live.wait(10) == -signal.SIGKILL
    finally:
        live.kill()
