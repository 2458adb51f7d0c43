"""Run an untrusted Python program against unit tests in a sandboxed subprocess.

What: `CodeSandbox(cfg).run(program, tests) -> SandboxResult(passed, reason, message, ...)`. `tests` is
Python source; every top-level `assert` is one test, other statements are setup (assert_judge.py has the
exact contract). Why: code rewards execute model-written programs; a reward worker must survive infinite
loops, memory and fork bombs, network access, writes and reads on the host and reward hacking, and report
which one happened.
How (isolation "namespaces", root + `unshare`): fresh network namespace (no interfaces up, not even
loopback), IPC namespace (SysV IPC and POSIX queues die with the run), pid namespace (nothing outside is
visible or killable; everything dies with its init), mount namespace with every mount read-only, the host's
temp dirs, the worker's working directory (where run directories live) and cfg.hide covered by empty
root-owned tmpfs (mode 0000: every path below is EACCES), and a private size-limited tmpfs under
NS_WORK_BASE as the only writable directory (also HOME and TMPDIR); a fresh unprivileged uid per run (so
RLIMIT_NPROC counts only this run's processes), PR_SET_NO_NEW_PRIVS, a seccomp filter (libseccomp) refusing
new namespaces, mount, ptrace, SysV IPC and kernel-level calls, rlimits on CPU, address space, processes,
file size, open files. Memory of the whole tree: a per-run cgroup capped at memory_mb where the worker may
create one (cgroup.py; SandboxResult.memory_bound says which), else memory_mb x max_processes.
Fails closed: as root without namespaces (no working `unshare`), isolation "auto" and "rlimits" refuse to
run anything (`SandboxRefused`; the code reward then gives the task's default reward with the reason).
Isolation "rlimits" is for non-root workers: rlimits, a private temp dir and an audit hook refusing sockets
and outside writes (a ctypes call bypasses the hook; the uid's own files and processes are reachable).
"unsafe" runs that mode even as root, by name only: for debugging.
The verdict is never computed next to the program: assert_judge.judge rebuilds each assert from the plain
values the runner sends back and evaluates it in this process. The wall deadline and the output cap are
enforced here, and every process of the run is killed at the end (process group, the run's cgroup, then
every process of the sandbox uid).

    reason: passed | tests_failed | no_tests | error | syntax_error | exited_early | timeout | cpu_limit |
            memory_limit | process_limit | network_blocked | write_blocked | read_blocked | syscall_blocked |
            bad_result_type | tampered | output_limit | crashed | sandbox_error

Run: python -c "from areal_mq.rewards.sandbox.runner import CodeSandbox; print(CodeSandbox().run('x=1', 'assert x==1'))"
"""
from __future__ import annotations

import ctypes
import json
import os
import secrets
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field

from areal_mq.errors import RewardError
from areal_mq.rewards.config import SandboxConfig
from areal_mq.rewards.sandbox.cgroup import RunCgroup, sigkill_all
from areal_mq.rewards.sandbox.assert_judge import Plan, judge, plan_tests

BOOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "boot.py")
UNSHARE = ["unshare", "--net", "--ipc", "--mount", "--pid", "--fork", "--kill-child", "--mount-proc",
           "--propagation", "private"]
HOST_TEMP = ("/tmp", "/var/tmp", "/dev/shm")
NS_WORK_BASE = "/run/areal-mq-sandbox"  # mount points of the private dirs: outside the host temp dirs we hide
MESSAGES = {
    "passed": "all tests passed", "tests_failed": "a test assertion failed", "no_tests": "no assert in the tests",
    "error": "the program raised", "syntax_error": "the program does not compile",
    "timeout": "wall-clock limit exceeded; every process of the run was killed",
    "cpu_limit": "CPU time limit exceeded", "memory_limit": "memory limit exceeded",
    "process_limit": "process limit reached (fork refused)", "network_blocked": "network access refused",
    "write_blocked": "write outside the sandbox directory refused",
    "read_blocked": "read refused (host temp and run directories are hidden; other files may be unreadable "
                    "for the run's user)",
    "output_limit": "output limit exceeded; the run was killed",
    "exited_early": "the program exited before the tests finished", "crashed": "the program was killed by a signal",
    "syscall_blocked": "a system call the sandbox forbids was refused (namespaces, mount, ptrace, another "
                       "user's process, ...)",
    "bad_result_type": "a program value a test needs is not plain data (int, float, bool, str, bytes, None, "
                       "list, tuple, dict, set, frozenset); it cannot be compared safely",
    "tampered": "the program wrote on the sandbox's status pipe (a test result arrived twice)",
    "sandbox_error": "the sandbox itself failed",
}


# the reasons (of MESSAGES) that mean the sandbox refused something the program tried
REFUSALS = frozenset({"process_limit", "network_blocked", "write_blocked", "read_blocked", "syscall_blocked"})


class SandboxRefused(RewardError):
    """The sandbox would not isolate the program on this machine, so it runs nothing (fails closed)."""


@dataclass
class SandboxResult:
    """Outcome of one sandboxed run; `reason` is one of the codes in the module docstring."""

    passed: bool
    reason: str
    message: str
    tests_passed: int = 0
    tests_total: int = 0
    stdout: str = ""
    stderr: str = ""
    duration_s: float = 0.0
    cpu_s: float | None = None
    isolation: str = ""
    memory_bound: str = ""  # what bounded the memory of the whole process tree (a cgroup, or rlimits)
    failures: list = field(default_factory=list)


def namespaces_available() -> bool:
    """True when we are root and `unshare` can create network, mount and pid namespaces here."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return False
    try:
        return subprocess.run(UNSHARE + ["true"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def _others_can_run_python() -> bool:
    path = os.path.realpath(sys.base_prefix)
    while path != "/":
        path = os.path.dirname(path)
        if not os.stat(path).st_mode & 0o001:
            return False
    return True


def _set_pdeathsig() -> None:  # runs in the child between fork and exec
    ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _uid_pids(uid: int) -> list[int]:
    pids = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/status") as f:
                    for line in f:
                        if line.startswith("Uid:"):
                            if int(line.split()[1]) == uid:
                                pids.append(int(name))
                            break
            except OSError:
                continue
    return pids


class CodeSandbox:
    """Runs programs under `cfg` limits. Safe to reuse and to share between threads."""

    def __init__(self, cfg: SandboxConfig | None = None, namespaces: bool | None = None):
        """`namespaces`: whether namespaces work here (default: probe with `unshare`); passed in by tests."""
        self.cfg = cfg or SandboxConfig()
        have_ns = namespaces_available() if namespaces is None else namespaces
        root = os.geteuid() == 0
        want = self.cfg.isolation
        self.refusal = ""
        if want == "unsafe":
            self.isolation = "rlimits"
        elif want in ("auto", "namespaces") and have_ns:
            self.isolation = "namespaces"
        elif want == "namespaces" or root:
            self.isolation = "refused"
            why = {"namespaces": "namespaces need root and a working `unshare` (util-linux)",
                   "rlimits": "this worker runs as root, so the program would run as root with every capability",
                   "auto": "this worker runs as root and namespaces are not available (no working `unshare`), so "
                           "the program would run as root with every capability"}[want]
            self.refusal = (f"sandbox isolation {want!r} refused: {why}; fix the host, run the reward worker as a "
                            "normal user, or set isolation: unsafe (debugging only)")
        else:
            self.isolation = "rlimits"

    def run(self, program: str, tests: str) -> SandboxResult:
        """Run `program`, then `tests`, under the limits. Raises ValueError for unparsable tests and
        SandboxRefused when this machine cannot isolate the program (fail closed)."""
        if self.refusal:
            raise SandboxRefused(self.refusal)
        plan = plan_tests(tests, program)
        ns = self.isolation == "namespaces"
        uid = None
        if os.geteuid() == 0 and (ns or _others_can_run_python()):
            uid = 200_000 + secrets.randbelow(800_000)  # fresh per run: RLIMIT_NPROC and the kill sweep see only us
        workdir = tempfile.mkdtemp(prefix="areal-sbx-", dir=self._work_base())
        group = RunCgroup.create(self.cfg.memory_mb) if self.cfg.cgroup else None
        try:
            if uid is not None:
                os.chown(workdir, uid, uid)
            return self._run_in(workdir, uid, program, plan, group)
        finally:
            if group is not None:
                group.remove()
            shutil.rmtree(workdir, ignore_errors=True)
            shutil.rmtree(workdir + ".py", ignore_errors=True)  # where boot bind-mounted a buried Python (empty here)

    def _boot_config(self, workdir, uid, program, plan: Plan, status_fd, nonce, group) -> dict:
        c = self.cfg
        ns = self.isolation == "namespaces"
        return {
            "dir": workdir, "uid": uid, "mounts": ns, "seccomp": ns, "mask": self._masks() if ns else [],
            "deny_processes": uid is None and os.geteuid() == 0,  # root ignores RLIMIT_NPROC: no forks at all
            "disk_mb": c.disk_mb, "status_fd": status_fd, "cgroup_procs": group.procs if group else None,
            "nonce": nonce, "program": program, "steps": plan.steps,
            "expose": [sys.base_prefix, sys.prefix] if ns else [],
            "limits": {"cpu_s": c.cpu_s, "memory_mb": c.memory_mb, "max_processes": c.max_processes,
                       "fsize_mb": c.disk_mb},
        }

    def _masks(self) -> list[str]:
        """Directories the program must not read: host temp dirs, this worker's working directory (where
        run directories live) and cfg.hide. The boot script puts the Python it runs on back where a mask
        covers it."""
        out = []
        for d in (*HOST_TEMP, os.getcwd(), *self.cfg.hide):
            real = os.path.realpath(d)
            if real != "/" and real not in out:
                out.append(real)
        return out

    def _work_base(self) -> str | None:
        """Where the run's directory is made: with namespaces, NS_WORK_BASE (so /tmp can be hidden whole:
        every path under it is then EACCES, not ENOENT); else the usual temp dir."""
        if self.isolation != "namespaces":
            return None
        try:
            os.makedirs(NS_WORK_BASE, mode=0o711, exist_ok=True)
            return NS_WORK_BASE
        except OSError:
            return None

    def _run_in(self, workdir, uid, program, plan: Plan, group: RunCgroup | None) -> SandboxResult:
        nonce = secrets.token_hex(16)
        status_r, status_w = os.pipe()
        cmd = [sys.executable, "-I", "-B"] + ([] if self.cfg.site_packages else ["-S"]) + [BOOT]
        if self.isolation == "namespaces":
            cmd = UNSHARE + cmd
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": workdir, "LANG": "C.UTF-8", "TMPDIR": workdir}
        in_main = threading.current_thread() is threading.main_thread()
        start = time.monotonic()
        try:
            proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    pass_fds=(status_w,), start_new_session=True, env=env, cwd=workdir,
                                    preexec_fn=_set_pdeathsig if in_main else None)
        finally:
            os.close(status_w)
        try:
            cfg = self._boot_config(workdir, uid, program, plan, status_w, nonce, group)
            try:
                proc.stdin.write(json.dumps(cfg).encode())
                proc.stdin.close()
            except BrokenPipeError:
                pass
            bufs, killed = self._collect(proc, status_r, start)
        finally:
            self._kill_all(proc, uid)
            os.close(status_r)
            for pipe in (proc.stdout, proc.stderr):
                pipe.close()
        oom = group is not None and group.oom_killed()
        result = self._result(bufs, killed, nonce, time.monotonic() - start, plan)
        result.memory_bound = self._memory_bound(group)
        if oom and not result.passed and result.reason not in ("timeout", "output_limit"):
            result.reason = "memory_limit"
            result.message = f"{MESSAGES['memory_limit']}: {result.memory_bound}; the kernel killed a process"
        return result

    def _memory_bound(self, group: RunCgroup | None) -> str:
        c = self.cfg
        if group is not None:
            return f"cgroup v{group.version}: {c.memory_mb} MiB for the whole process tree"
        return f"rlimits: {c.memory_mb} MiB per process x {c.max_processes} processes"

    def _collect(self, proc, status_r, start) -> tuple[dict, str | None]:
        """Read stdout, stderr and the status pipe until all close, the deadline or the output cap."""
        sel = selectors.DefaultSelector()
        names = {proc.stdout.fileno(): "stdout", proc.stderr.fileno(): "stderr", status_r: "status"}
        for fd in names:
            sel.register(fd, selectors.EVENT_READ)
        bufs = {"stdout": bytearray(), "stderr": bytearray(), "status": bytearray()}
        deadline, exited_at = start + self.cfg.timeout_s, None
        try:
            while sel.get_map():
                now = time.monotonic()
                if now >= deadline:
                    return bufs, "timeout"
                if exited_at is None and proc.poll() is not None:
                    exited_at = now
                if exited_at is not None and now - exited_at > 0.5:  # leftovers hold our pipes: kill them
                    return bufs, None
                for key, _ in sel.select(min(deadline - now, 0.1)):
                    data = os.read(key.fd, 65536)
                    if not data:
                        sel.unregister(key.fd)
                        continue
                    bufs[names[key.fd]] += data
                    if len(bufs["stdout"]) + len(bufs["stderr"]) > self.cfg.max_output_bytes:
                        return bufs, "output_limit"
                    if len(bufs["status"]) > 1_000_000:
                        return bufs, "output_limit"
            return bufs, None
        finally:
            sel.close()

    def _kill_all(self, proc, uid) -> None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        proc.wait()
        if uid is None:
            return
        for _ in range(100):  # processes that left our group (setsid) are still the sandbox uid's
            pids = _uid_pids(uid)
            if not pids:
                return
            sigkill_all(pids)

    def _result(self, bufs, killed, nonce, duration, plan: Plan) -> SandboxResult:
        out = bytes(bufs["stdout"][-4096:]).decode("utf-8", "replace")
        err = bytes(bufs["stderr"][-4096:]).decode("utf-8", "replace")
        lines, exit_line = [], None
        for raw in bytes(bufs["status"]).splitlines():
            try:
                line = json.loads(raw)
            except (ValueError, RecursionError):  # a line the program forged: only its own claims count
                continue
            if isinstance(line, dict) and line.get("nonce") == nonce:
                if line.get("kind") == "exit":
                    exit_line = line
                else:
                    lines.append(line)
        common = {"stdout": out, "stderr": err, "duration_s": round(duration, 3), "isolation": self.isolation,
                  "cpu_s": exit_line.get("cpu_s") if exit_line else None}
        if killed:
            return SandboxResult(False, killed, f"{MESSAGES[killed]} ({self._limit_text(killed)})", **common)
        verdict = judge(plan, lines)  # computed here, never by the program's process
        reason = verdict["reason"]
        if reason:
            detail = verdict["exc"]
            msg = MESSAGES.get(reason, reason) + (f": {detail}" if detail and reason != "passed" else "")
            return SandboxResult(reason == "passed", reason, msg, verdict["passed"], verdict["total"],
                                 failures=verdict["failures"], **common)
        reason, msg = self._exit_reason(exit_line)
        return SandboxResult(False, reason, msg, verdict["passed"], verdict["total"], **common)

    def _exit_reason(self, exit_line) -> tuple[str, str]:
        if exit_line is None:
            return "sandbox_error", "the sandbox exited without a status (see stderr)"
        sig = exit_line.get("signal")
        cpu = exit_line.get("cpu_s") or 0.0
        if sig == signal.SIGXCPU or (sig == signal.SIGKILL and cpu >= self.cfg.cpu_s):
            return "cpu_limit", f"{MESSAGES['cpu_limit']} ({self._limit_text('cpu_limit')}, used {cpu:.2f}s)"
        if sig is not None:
            return "crashed", f"{MESSAGES['crashed']} ({signal.Signals(sig).name})"
        return "exited_early", f"{MESSAGES['exited_early']} (exit code {exit_line.get('code')})"

    def _limit_text(self, reason: str) -> str:
        c = self.cfg
        return {"timeout": f"{c.timeout_s}s", "cpu_limit": f"{c.cpu_s}s CPU",
                "output_limit": f"{c.max_output_bytes} bytes"}.get(reason, "")
