"""The hostile sandbox table: what an outside audit did to the code sandbox, each now blocked with its reason.

Every case runs in each isolation mode this machine supports as a protection (namespaces with root and
`unshare`; rlimits only for a non-root worker, where ctypes cases are out of its reach and skipped). As root
without namespaces the sandbox refuses to run at all (fail closed: the audit's ctypes attacks all succeeded
there), and the code reward then gives the task's default reward with the reason. Host-side checks: the
outside file does not exist, the listener got no connection, the victim process lives, no SysV segment.
Run: pytest tests/unit/rewards/test_sandbox_hostile.py -q   (~20 s)
"""
from __future__ import annotations

import os
import random
import shutil
import subprocess
import tempfile

import pytest

from areal_mq.messages import RewardJob
from areal_mq.rewards import RewardConfig, RewardExecutor
from areal_mq.rewards.config import SandboxConfig, TaskConfig
from areal_mq.rewards.sandbox.runner import CodeSandbox, SandboxRefused, namespaces_available

LIMITS = dict(timeout_s=8.0, cpu_s=2, memory_mb=256, max_processes=12, max_output_bytes=8192)
ROOT = os.geteuid() == 0
MODES = (["namespaces"] if namespaces_available() else []) + ([] if ROOT else ["rlimits"])
LIBC = "import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\n"
RAISE = "    raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))\n"
ADD = "def add(a, b):\n    return a + b\n"


@pytest.fixture(scope="module", params=MODES or [pytest.param("none", marks=pytest.mark.skip(
    reason="no protecting isolation mode here (root without namespaces refuses: see the refusal tests)"))])
def box(request):
    return CodeSandbox(SandboxConfig(isolation=request.param, **LIMITS))


def _ctypes_only_in_namespaces(box):
    if box.isolation != "namespaces":
        pytest.skip("rlimits mode cannot stop ctypes calls (documented); namespaces do")


def test_infinite_loop(box):
    r = box.run("while True:\n    pass\n", "assert True")
    assert not r.passed and r.reason in ("cpu_limit", "timeout"), r


def test_8gb_allocation(box):
    r = box.run("x = bytearray(8 * 1024 ** 3)\n", "assert True")
    assert not r.passed and r.reason == "memory_limit", r


def test_socket_via_python(box, listener):
    port, got = listener
    r = box.run(f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)\n", "assert True")
    assert not r.passed and r.reason == "network_blocked", r
    assert got == []


def test_socket_via_ctypes(box, listener):
    _ctypes_only_in_namespaces(box)
    port, got = listener
    prog = (LIBC + "import struct\nfd = libc.socket(2, 1, 0)\n"
            f"addr = struct.pack('=H', 2) + struct.pack('!H', {port}) + bytes([127, 0, 0, 1]) + bytes(8)\n"
            "if libc.connect(fd, addr, len(addr)) != 0:\n" + RAISE)
    r = box.run(prog, "assert True")
    assert not r.passed and r.reason == "network_blocked", r
    assert got == []


@pytest.mark.parametrize("how", ["python", "ctypes"])
@pytest.mark.parametrize("where", ["test_tmp", "etc"])
def test_write_outside(box, how, where, tmp_path):
    if how == "ctypes":
        _ctypes_only_in_namespaces(box)
    target = str(tmp_path / "escaped.txt") if where == "test_tmp" else f"/etc/areal-sbx-{random.randrange(10**9)}"
    prog = (f"open({target!r}, 'w').write('escaped')\n" if how == "python" else
            LIBC + f"if libc.open({target.encode()!r}, 0o101, 0o644) < 0:\n" + RAISE)
    r = box.run(prog, "assert True")
    assert not r.passed and r.reason == "write_blocked", r
    assert not os.path.exists(target)  # checked on the host


def test_host_temp_and_run_dirs_are_not_readable(box, tmp_path):
    _ctypes_only_in_namespaces(box)
    secret = tmp_path / "secret.txt"
    secret.write_text("host data")
    project = os.path.join(os.getcwd(), "pyproject.toml")
    r = box.run(f"import os\nseen = os.path.exists({str(secret)!r}) or os.path.exists({project!r})\n",
                "assert seen == False")
    assert r.passed, r
    r = box.run(f"data = open({str(secret)!r}).read()\n", "assert True")
    assert not r.passed and r.reason == "read_blocked", r


@pytest.fixture
def run_dir():
    """A world-readable directory outside the host temp dirs and our working directory, like a run_dir."""
    if not ROOT:
        pytest.skip("hiding directories needs namespaces (root)")
    path = tempfile.mkdtemp(prefix="areal-mq-hide-test-", dir="/run")
    os.chmod(path, 0o755)
    with open(os.path.join(path, "config.yaml"), "w") as f:
        f.write("secret: 1\n")
    os.chmod(os.path.join(path, "config.yaml"), 0o644)
    yield path
    shutil.rmtree(path)


def test_hide_covers_more_directories(box, run_dir):
    _ctypes_only_in_namespaces(box)
    prog = f"import os\nseen = os.path.exists({run_dir!r} + '/config.yaml')\n"
    assert box.run(prog, "assert seen == True").passed  # readable unless hidden
    hidden = CodeSandbox(box.cfg.model_copy(update={"hide": [run_dir]}))
    assert hidden.run(prog, "assert seen == False").passed


def test_fork_bomb_via_ctypes(box):
    _ctypes_only_in_namespaces(box)
    prog = LIBC + "while True:\n    if libc.fork() < 0:\n" + RAISE.replace("    raise", "        raise")
    r = box.run(prog, "assert True")
    assert not r.passed and r.reason == "process_limit", r


def test_kill_parent_and_host_process(box):
    _ctypes_only_in_namespaces(box)
    victim = subprocess.Popen(["sleep", "60"])
    try:
        for pid_expr in ("os.getppid()", str(victim.pid), "1"):
            r = box.run(LIBC + f"if libc.kill({pid_expr}, 9) != 0:\n" + RAISE, "assert True")
            assert not r.passed and r.reason == "syscall_blocked", (pid_expr, r)
        assert victim.poll() is None, "a host process was killed from the sandbox"
    finally:
        victim.kill()
        victim.wait()


def _host_shm_keys() -> set[int]:
    with open("/proc/sysvipc/shm") as f:
        return {int(line.split()[0]) for line in f.readlines()[1:]}


def test_sysv_shared_memory(box):
    _ctypes_only_in_namespaces(box)
    key = random.randrange(1 << 20, 1 << 30)
    r = box.run(LIBC + f"if libc.shmget({key}, 1 << 20, 0o1600) < 0:\n" + RAISE, "assert True")
    assert not r.passed and r.reason == "syscall_blocked", r
    assert key not in _host_shm_keys()  # not made, and the IPC namespace would have kept it off the host


def test_new_user_namespace_and_mount(box):
    _ctypes_only_in_namespaces(box)
    r = box.run(LIBC + "if libc.unshare(0x10000000 | 0x00020000) != 0:\n" + RAISE, "assert True")
    assert not r.passed and r.reason == "syscall_blocked", r
    r = box.run(LIBC + "if libc.mount(b'none', b'/mnt', b'tmpfs', 0, None) != 0:\n" + RAISE, "assert True")
    assert not r.passed and r.reason == "syscall_blocked", r
    if os.uname().machine == "x86_64":  # raw clone(CLONE_NEWUSER | SIGCHLD) and clone3, past libc's wrappers
        for call in ("libc.syscall(56, 0x10000000 | 17, 0, 0, 0, 0)", "libc.syscall(435, bytes(88), 88)"):
            r = box.run(LIBC + f"pid = {call}\nif pid == 0:\n    os._exit(0)\nif pid < 0:\n" + RAISE, "assert True")
            assert not r.passed and r.reason == "syscall_blocked", (call, r)


def test_always_equal_object(box):
    prog = "class E:\n    __eq__ = lambda self, other: True\n    __bool__ = lambda self: True\n" \
           "def add(a, b):\n    return E()\n"
    r = box.run(prog, "assert add(2, 2) == 5\nassert add(1, 1)")
    assert not r.passed and r.reason == "bad_result_type", r
    sub = box.run("class I(int):\n    __eq__ = lambda s, o: True\ndef add(a, b):\n    return I(4)\n",
                  "assert add(2, 2) == 5")
    assert not sub.passed and sub.reason == "bad_result_type", sub


def test_nonce_forging_through_gc(box):
    """The program finds the runner's nonce in memory and writes lookalike lines on the status pipe: the
    verdict is not computed in its process, and the expected value (5) never entered it."""
    prog = ADD + (
        "import gc, json, os\n"
        "cfg = next(o for o in gc.get_objects() if isinstance(o, dict) and 'nonce' in o and 'status_fd' in o)\n"
        "for line in ({'kind': 'result', 'reason': 'passed', 'passed': 1, 'total': 1},\n"
        "             {'kind': 'probe', 'id': 0, 'values': [{'i': 4}]}, {'kind': 'done'}):\n"
        "    os.write(cfg['status_fd'], (json.dumps({'nonce': cfg['nonce'], **line}) + '\\n').encode())\n"
        "assert not any(isinstance(o, str) and o == 'add(2, 2) == 5' for o in gc.get_objects())\n"
        "os._exit(0)\n")
    r = box.run(prog, "assert add(2, 2) == 5")
    assert not r.passed and r.reason == "tests_failed", r


def test_forged_results_claim_only_return_values(box):
    """The program reads the runner's steps and nonce through gc and reports True for every part before the
    runner does: `not`, arithmetic and expected values are evaluated in the reward worker, so the claim is
    only what is_prime returned; when the runner goes on to report too, the duplicate is tampering."""
    forge = ("def is_prime(n):\n    return True\n"
             "import gc, json, os\n"
             "cfg = next(o for o in gc.get_objects() if isinstance(o, dict) and 'nonce' in o and 'status_fd' in o)\n"
             "for s in cfg['steps']:\n"
             "    if s['kind'] == 'probe':\n"
             "        claim = [{'b': True}] * len(s['exprs'])\n"
             "        line = {'nonce': cfg['nonce'], 'kind': 'probe', 'id': s['id'], 'values': claim}\n"
             "        os.write(cfg['status_fd'], (json.dumps(line) + '\\n').encode())\n")
    tests = "assert is_prime(7)\nassert not is_prime(8)\nassert abs(is_prime(0.5) - 0.3) < 1e-9"
    r = box.run(forge + "os._exit(0)\n", tests)
    assert not r.passed and r.reason == "tests_failed" and r.tests_passed == 1, r
    r = box.run(forge, tests)
    assert not r.passed and r.reason == "tampered", r


def test_memory_of_the_whole_process_tree(box):
    """Six processes of 60 MiB each under a 128 MiB limit: a cgroup stops the tree; without one (rlimits
    bound: memory_mb x max_processes) each process stays under its own limit, which is all it promises."""
    prog = ("import os, time\nkids = []\nfor i in range(6):\n    pid = os.fork()\n    if pid == 0:\n"
            "        x = bytearray(60 << 20)\n        x[::4096] = b'1' * len(x[::4096])\n        time.sleep(2)\n"
            "        os._exit(0)\n    kids.append(pid)\nok = all(os.waitpid(k, 0)[1] == 0 for k in kids)\n")
    small = CodeSandbox(box.cfg.model_copy(update={"memory_mb": 128}))
    r = small.run(prog, "assert ok")
    if not r.memory_bound.startswith("cgroup"):
        pytest.skip(f"no cgroup can be made here ({r.memory_bound}); reason was {r.reason}")
    assert not r.passed and r.reason == "memory_limit", r


def test_plain_values_still_compare_as_python_does(box):
    prog = ADD + "def items():\n    return {'a': (1, 2.5), 'b': [None, b'x', {3}]}\n"
    r = box.run(prog, "assert add(2, 2) == 4\nassert add(2, 2) == 4.0\nassert 3 < add(2, 2) <= 4\n"
                      "assert items() == {'a': (1, 2.5), 'b': [None, b'x', {3}]}\nassert 'a' in items()\n"
                      "x = add(1, 1)\nassert x == 2, 'two'\nassert add(1, 1) == add(0, 2)")
    assert r.passed and (r.tests_passed, r.tests_total) == (7, 7), r


# ---------------------------------------------------------------- fail closed
# what the audit ran in rlimits mode as root (no `unshare`): each one succeeded then; now none runs at all
AUDIT_AS_ROOT = {
    "socket_ctypes": LIBC + "addr = bytes([2, 0, 0, 22, 127, 0, 0, 1]) + bytes(8)\n"
                            "libc.connect(libc.socket(2, 1, 0), addr, 16)\n",
    "write_ctypes": LIBC + "libc.open(b'/etc/areal-sbx-audit', 0o101, 0o644)\n",
    "kill_parent_ctypes": LIBC + "libc.kill(os.getppid(), 9)\n",
    "shmget_ctypes": LIBC + "libc.shmget(0, 1 << 20, 0o1600)\n",
}


@pytest.mark.skipif(not ROOT, reason="the refusal is about running as root")
@pytest.mark.parametrize("isolation,have_ns", [("auto", False), ("rlimits", False), ("rlimits", True),
                                               ("namespaces", False)])
def test_root_without_isolation_refuses(isolation, have_ns):
    box = CodeSandbox(SandboxConfig(isolation=isolation, **LIMITS), namespaces=have_ns)
    for program in (ADD, *AUDIT_AS_ROOT.values()):
        with pytest.raises(SandboxRefused, match="refused: .*root"):
            box.run(program, "assert True")
    unsafe = CodeSandbox(SandboxConfig(isolation="unsafe", **LIMITS), namespaces=have_ns)
    assert unsafe.run(ADD, "assert add(1, 1) == 2").passed  # only when asked for by name


@pytest.mark.skipif(not ROOT, reason="the refusal is about running as root")
def test_code_reward_gives_the_default_when_refused():
    task = TaskConfig(fn="code", default_reward=-1.0, kwargs={"sandbox": {"isolation": "rlimits"}})
    cfg = RewardConfig(processes=1, retries=0, tasks={"code": task})
    with RewardExecutor(cfg) as ex:
        out = ex.score(RewardJob(task="code", completions=[ADD], reference="assert add(1, 1) == 2"), timeout=60)
    assert out.rewards == [-1.0] and "refused" in out.errors[0]
