"""Run an untrusted Python program against unit tests in a sandboxed subprocess.

What: `CodeSandbox(cfg).run(program, tests) -> SandboxResult(passed, reason, message, ...)`. `tests` is
Python source; every top-level `assert` is one test, other statements are setup run in order.
Why: code rewards execute model-written programs; a reward worker must survive infinite loops, memory
and fork bombs, network access and writes anywhere on the host, and report which one happened.
How (isolation "namespaces", root + `unshare` available): fresh network namespace (no interfaces up, not
even loopback), mount namespace with every mount read-only and a private size-limited tmpfs as the
working directory, pid namespace (everything dies with its init), a fresh unprivileged uid per run
(so RLIMIT_NPROC counts only this run's processes), rlimits on CPU, address space, file size, open files.
Isolation "rlimits" (no root or no unshare): the same rlimits, a private temp dir, the uid switch when
root and Python is readable by other users, and an audit hook refusing sockets and outside writes.
Either way the wall deadline and the output cap are enforced here, and every process of the run is killed
at the end (process group, then every process of the sandbox uid).

    reason: passed | tests_failed | no_tests | error | syntax_error | exited_early | timeout | cpu_limit |
            memory_limit | process_limit | network_blocked | write_blocked | output_limit | crashed |
            sandbox_error

Run: python -c "from areal_mq.rewards.sandbox import CodeSandbox; print(CodeSandbox().run('x=1', 'assert x==1'))"
"""
from __future__ import annotations

import ast
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
from dataclasses import asdict, dataclass, field

from .config import SandboxConfig

BOOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_sandbox_boot.py")
UNSHARE = ["unshare", "--net", "--mount", "--pid", "--fork", "--kill-child", "--mount-proc",
           "--propagation", "private"]
MESSAGES = {
    "passed": "all tests passed", "tests_failed": "a test assertion failed", "no_tests": "no assert in the tests",
    "error": "the program raised", "syntax_error": "the program does not compile",
    "timeout": "wall-clock limit exceeded; every process of the run was killed",
    "cpu_limit": "CPU time limit exceeded", "memory_limit": "memory limit exceeded (MemoryError)",
    "process_limit": "process limit reached (fork refused)", "network_blocked": "network access refused",
    "write_blocked": "write outside the sandbox directory refused",
    "output_limit": "output limit exceeded; the run was killed",
    "exited_early": "the program exited before the tests finished", "crashed": "the program was killed by a signal",
    "sandbox_error": "the sandbox itself failed",
}


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
    failures: list = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


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

    def __init__(self, cfg: SandboxConfig | None = None):
        self.cfg = cfg or SandboxConfig()
        if self.cfg.isolation == "rlimits":
            self.isolation = "rlimits"
        elif namespaces_available():
            self.isolation = "namespaces"
        elif self.cfg.isolation == "namespaces":
            raise RuntimeError("sandbox isolation 'namespaces' needs root and a working `unshare` "
                               "(util-linux); use isolation 'auto' or 'rlimits' here")
        else:
            self.isolation = "rlimits"

    def run(self, program: str, tests: str) -> SandboxResult:
        """Run `program`, then `tests`, under the limits. Raises ValueError only for unparsable tests."""
        try:
            ast.parse(tests)
        except SyntaxError as exc:
            raise ValueError(f"the unit tests do not parse (line {exc.lineno}: {exc.msg}); fix the reference") from None
        ns = self.isolation == "namespaces"
        uid = None
        if os.geteuid() == 0 and (ns or _others_can_run_python()):
            uid = 200_000 + secrets.randbelow(800_000)  # fresh per run: RLIMIT_NPROC and the kill sweep see only us
        workdir = tempfile.mkdtemp(prefix="areal-sbx-")
        try:
            if uid is not None:
                os.chown(workdir, uid, uid)
            return self._run_in(workdir, uid, program, tests)
        finally:
            shutil.rmtree(workdir, ignore_errors=True)

    def _boot_config(self, workdir, uid, program, tests, status_fd, nonce) -> dict:
        c = self.cfg
        ns = self.isolation == "namespaces"
        return {
            "dir": workdir, "uid": uid, "mounts": ns,
            "deny_processes": uid is None and os.geteuid() == 0,  # root ignores RLIMIT_NPROC: no forks at all
            "disk_mb": c.disk_mb, "status_fd": status_fd,
            "nonce": nonce, "program": program, "tests": tests,
            "expose": [sys.base_prefix, sys.prefix] if ns else [],
            "limits": {"cpu_s": c.cpu_s, "memory_mb": c.memory_mb, "max_processes": c.max_processes,
                       "fsize_mb": c.disk_mb},
        }

    def _run_in(self, workdir, uid, program, tests) -> SandboxResult:
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
            cfg = self._boot_config(workdir, uid, program, tests, status_w, nonce)
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
        return self._result(bufs, killed, nonce, time.monotonic() - start)

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
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.01)

    def _result(self, bufs, killed, nonce, duration) -> SandboxResult:
        out = bytes(bufs["stdout"][-4096:]).decode("utf-8", "replace")
        err = bytes(bufs["stderr"][-4096:]).decode("utf-8", "replace")
        result, exit_line = None, None
        for raw in bytes(bufs["status"]).splitlines():
            try:
                line = json.loads(raw)
            except ValueError:
                continue
            if isinstance(line, dict) and line.get("nonce") == nonce:
                if line.get("kind") == "result" and result is None:
                    result = line
                elif line.get("kind") == "exit":
                    exit_line = line
        common = {"stdout": out, "stderr": err, "duration_s": round(duration, 3), "isolation": self.isolation,
                  "cpu_s": exit_line.get("cpu_s") if exit_line else None}
        if killed:
            return SandboxResult(False, killed, f"{MESSAGES[killed]} ({self._limit_text(killed)})", **common)
        if result is not None:
            reason = result["reason"]
            detail = result.get("exc") or (result["failures"][0]["exc"] if result.get("failures") else "")
            msg = MESSAGES.get(reason, reason) + (f": {detail}" if detail and reason != "passed" else "")
            return SandboxResult(reason == "passed", reason, msg, result.get("passed", 0), result.get("total", 0),
                                 failures=result.get("failures", []), **common)
        return SandboxResult(False, *self._exit_reason(exit_line), **common)

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
