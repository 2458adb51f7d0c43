"""areal_mq/actor/exit.py exit_now: the exit code, a non-daemon thread's work, atexit handlers and buffered output all
survive the skipped teardown; AREAL_MQ_EXIT=full takes the interpreter's own exit."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

SCRIPT = r"""
import atexit, sys, threading, time
from pathlib import Path
out = Path(sys.argv[1])
def late():
    time.sleep(0.3)
    (out / "thread").write_text("done")
threading.Thread(target=late).start()
atexit.register(lambda: (out / "atexit").write_text("ran"))
sys.stdout.write("buffered, no newline")
from areal_mq.actor.exit import exit_now
exit_now(7)
"""


@pytest.mark.parametrize("mode", ["fast", "full"])
def test_code_thread_atexit_and_output_survive(tmp_path, mode):
    env = {**os.environ, "AREAL_MQ_EXIT": "full" if mode == "full" else ""}
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path)], capture_output=True, text=True, timeout=60,
                          env=env)
    assert done.returncode == 7, done.stderr
    assert done.stdout == "buffered, no newline"
    assert (tmp_path / "thread").read_text() == "done" and (tmp_path / "atexit").read_text() == "ran"
