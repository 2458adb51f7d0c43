"""The code sandbox stops what a model-written program must not do, each with a clear reason.

Run: pytest tests/unit/rewards/test_sandbox.py -q   (~15 s; namespace tests skip where `unshare` cannot run)
"""
import os
import random

import pytest

from areal_mq.rewards.code_reward import code_reward, extract_program
from areal_mq.rewards.config import SandboxConfig
from areal_mq.rewards.sandbox.runner import CodeSandbox, namespaces_available
from areal_mq.testing import wait_for

LIMITS = dict(timeout_s=8.0, cpu_s=2, memory_mb=256, max_processes=12, max_output_bytes=8192)
HAS_NS = namespaces_available()


# "rlimits" is refused as root (tests/unit/rewards/test_sandbox_hostile.py); "unsafe" is that mode on purpose
@pytest.fixture(scope="module", params=["auto", "unsafe" if os.geteuid() == 0 else "rlimits"])
def sandbox(request):
    return CodeSandbox(SandboxConfig(isolation=request.param, **LIMITS))


@pytest.fixture(scope="module")
def ns_sandbox():
    if not HAS_NS:
        pytest.skip("needs root and unshare (network/mount/pid namespaces)")
    return CodeSandbox(SandboxConfig(isolation="namespaces", **LIMITS))


def test_passing_and_failing_tests(sandbox):
    prog = "def add(a, b):\n    return a + b\n"
    ok = sandbox.run(prog, "assert add(1, 2) == 3\nassert add(0, 0) == 0")
    assert ok.passed and ok.reason == "passed" and (ok.tests_passed, ok.tests_total) == (2, 2)
    bad = sandbox.run(prog, "assert add(1, 2) == 3\nassert add(1, 1) == 3, 'one plus one'")
    assert not bad.passed and bad.reason == "tests_failed" and (bad.tests_passed, bad.tests_total) == (1, 2)
    assert "one plus one" in bad.message


def test_program_errors(sandbox):
    assert sandbox.run("def f(:\n", "assert True").reason == "syntax_error"
    err = sandbox.run("raise KeyError('boom')", "assert True")
    assert err.reason == "error" and "KeyError" in err.message
    early = sandbox.run("import os\nos._exit(0)", "assert False")
    assert early.reason == "exited_early" and not early.passed
    forged = sandbox.run('import os\nos.write(3, b\'{"kind": "result", "reason": "passed"}\\n\')\nos._exit(0)',
                         "assert False")
    assert not forged.passed


def test_infinite_loop_is_stopped(sandbox):
    sandbox = CodeSandbox(sandbox.cfg.model_copy(update={"cpu_s": 1, "timeout_s": 6.0}))
    r = sandbox.run("while True:\n    pass\n", "assert True")
    assert not r.passed and r.reason in ("cpu_limit", "timeout"), r
    assert "limit" in r.message


def test_sleeping_program_hits_the_wall_clock_limit_and_its_children_die():
    box = CodeSandbox(SandboxConfig(**{**LIMITS, "timeout_s": 2.0}))
    marker = str(random.randrange(10**8, 10**9))
    prog = (f"import subprocess, time\nsubprocess.Popen(['sleep', '{marker}'], start_new_session=True)\n"
            "time.sleep(60)\n") if box.isolation == "namespaces" else "import time\ntime.sleep(60)\n"
    r = box.run(prog, "assert True")
    assert r.reason == "timeout" and "wall-clock" in r.message and r.duration_s < 10

    def leftovers() -> list[str]:
        found = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    if marker.encode() in f.read():
                        found.append(pid)
            except OSError:
                pass
        return found

    # killed at once, gone from /proc when reaped: wait for that, not a fixed 0.2 s
    wait_for(lambda: leftovers() == [], 10, what="the sandbox's children gone from /proc")


def test_memory_bomb(sandbox):
    r = sandbox.run("x = bytearray(4 * 1024 ** 3)\n", "assert True")
    assert r.reason == "memory_limit" and "memory" in r.message
    r = sandbox.run("chunks = []\nwhile True:\n    chunks.append(bytearray(10 ** 7))\n", "assert True")
    assert r.reason == "memory_limit"


def test_fork_bomb(sandbox):
    r = sandbox.run("import os\nwhile True:\n    os.fork()\n", "assert True")
    assert not r.passed and r.reason == "process_limit", r
    assert "process" in r.message


def test_network_connection_is_refused(sandbox, listener):
    port, got = listener
    r = sandbox.run(f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)\n", "assert True")
    assert r.reason == "network_blocked" and "network" in r.message
    assert got == []


def test_network_namespace_stops_a_child_process_too(ns_sandbox, listener):
    """A separate interpreter is not under the audit hook; the empty network namespace still stops it."""
    port, got = listener
    prog = ("import subprocess, sys\n"
            f"code = \"import socket; socket.create_connection(('127.0.0.1', {port}), timeout=2)\"\n"
            "r = subprocess.run(['python3', '-c', code], capture_output=True, text=True)\n"
            "print(r.stderr[-300:])\n")
    r = ns_sandbox.run(prog, "assert r.returncode == 0")
    assert r.reason == "tests_failed" and "Network is unreachable" in r.stdout
    assert got == []


def test_write_outside_the_directory_is_refused(sandbox, tmp_path):
    target = f"/tmp/areal-sbx-escape-{random.randrange(10**9)}"
    r = sandbox.run(f"open({target!r}, 'w').write('escaped')\n", "assert True")
    assert r.reason == "write_blocked" and target in r.message
    assert not os.path.exists(target)
    inside = sandbox.run("open('notes.txt', 'w').write('ok')\n", "assert open('notes.txt').read() == 'ok'")
    assert inside.passed, inside


def test_read_only_mounts_stop_a_shell_write(ns_sandbox):
    target = f"/tmp/areal-sbx-escape-{random.randrange(10**9)}"
    r = ns_sandbox.run(f"import os\nrc = os.system('echo x > {target}')\n", "assert rc == 0")
    assert r.reason == "tests_failed"
    assert not os.path.exists(target)


def test_output_flood_is_capped(sandbox):
    r = sandbox.run("while True:\n    print('y' * 1000)\n", "assert True")
    assert r.reason == "output_limit" and len(r.stdout) <= 4096


def test_unparsable_tests_are_the_references_fault(sandbox):
    with pytest.raises(ValueError, match="unit tests do not parse"):
        sandbox.run("x = 1", "assert (")


def test_code_reward_extracts_the_program_and_scores():
    completion = "Here you go:\n```python\ndef sq(x):\n    return x * x\n```\nDone."
    assert extract_program(completion).strip().startswith("def sq")
    tests = ["assert sq(2) == 4", "assert sq(3) == 9", "assert sq(4) == 15"]
    full = code_reward("", completion, {"tests": tests}, sandbox=LIMITS)
    assert full["reward"] == 0.0 and full["reason"] == "tests_failed"
    part = code_reward("", completion, tests, sandbox=LIMITS, partial_credit=True)
    assert part["reward"] == pytest.approx(2 / 3)
    good = code_reward("", completion, "assert sq(5) == 25", sandbox=LIMITS)
    assert good["reward"] == 1.0 and good["passed"]
