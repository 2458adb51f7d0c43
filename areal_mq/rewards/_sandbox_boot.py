"""Inside the code sandbox: isolate, drop privileges, run a candidate program and its tests, report.

Stdlib only: started by areal_mq.rewards.sandbox as `python -I -S -B _sandbox_boot.py` (optionally under
`unshare --net --mount --pid --fork --kill-child --mount-proc`), with a JSON config on stdin. Not meant
to be run by hand.

Two processes:
  boot (root, pid 1 of the pid namespace): makes every writable mount read-only, mounts a small private
      tmpfs on the sandbox directory, writes the program there, forks the runner, waits for it and
      writes an "exit" line (exit code, signal, CPU seconds) on the status pipe. When boot exits the
      kernel kills whatever the program left behind in the namespace.
  runner: sets rlimits (CPU, address space, processes, file size, open files), switches to a fresh
      unprivileged uid, installs an audit hook that refuses sockets and writes outside the directory,
      runs the program then each top-level test statement, and writes a "result" line.
Both lines carry the nonce given on stdin, so a program that exits early or prints lookalike lines
does not pass. (It is not proof against a program that reads the runner's own memory for the nonce.)
"""
import ast
import ctypes
import json
import os
import resource
import stat
import sys
import traceback

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND, MS_REC = 1, 2, 4, 8, 32, 4096, 16384
SKIP_FS = {"proc", "sysfs", "cgroup", "cgroup2", "devtmpfs", "devpts", "mqueue", "debugfs", "tracefs",
           "securityfs", "pstore", "bpf", "fusectl", "configfs", "hugetlbfs", "autofs", "binfmt_misc"}
WRITE_EVENTS = {"os.remove", "os.rename", "os.mkdir", "os.rmdir", "os.symlink", "os.link", "os.truncate",
                "os.chmod", "os.chown", "os.utime", "os.mkfifo", "os.mknod", "shutil.rmtree", "shutil.move",
                "shutil.copyfile", "shutil.copytree"}
PROC_EVENTS = {"os.fork", "os.forkpty", "os.posix_spawn", "os.exec", "os.spawn", "os.system", "os.startfile",
               "subprocess.Popen", "pty.spawn"}
NET_EVENTS = {"socket.connect", "socket.bind", "socket.sendto", "socket.sendmsg", "socket.getaddrinfo",
              "socket.gethostbyname", "socket.gethostbyaddr"}


def _mount(libc, source, target, fstype, flags, data):
    enc = lambda s: s.encode() if s is not None else None  # noqa: E731
    if libc.mount(enc(source), enc(target), enc(fstype), flags, enc(data)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount {source} on {target}: {os.strerror(err)}")


def _mounts():
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            fields = left.split()
            point = fields[4].encode().decode("unicode_escape")
            yield point, fields[5].split(","), right.split()[0]


def _expose(libc, path):
    """Make `path` reachable for other users when an ancestor (e.g. /root, 0700) is not: cover that
    ancestor with a tmpfs and bind the original `path` back at the same place."""
    path = os.path.realpath(path)
    cur = "/"
    for part in path.strip("/").split("/")[:-1]:
        cur = os.path.join(cur, part)
        if not os.stat(cur).st_mode & stat.S_IXOTH:
            fd = os.open(path, os.O_PATH | os.O_DIRECTORY)
            _mount(libc, "tmpfs", cur, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755,size=1m")
            os.makedirs(path, mode=0o755, exist_ok=True)
            _mount(libc, f"/proc/self/fd/{fd}", path, None, MS_BIND | MS_REC, None)
            os.close(fd)
            return


def isolate_filesystem(cfg):
    libc = ctypes.CDLL(None, use_errno=True)
    for path in cfg["expose"]:
        _expose(libc, path)
    for point, opts, fstype in list(_mounts()):
        if fstype in SKIP_FS or "ro" in opts or point.startswith(("/proc", "/sys")):
            continue
        extra = sum(flag for name, flag in (("nosuid", MS_NOSUID), ("nodev", MS_NODEV), ("noexec", MS_NOEXEC))
                    if name in opts)
        _mount(libc, None, point, None, MS_REMOUNT | MS_BIND | MS_RDONLY | extra, None)
    uid = cfg["uid"] if cfg["uid"] is not None else 0
    _mount(libc, "tmpfs", cfg["dir"], "tmpfs", MS_NOSUID | MS_NODEV,
           f"size={cfg['disk_mb']}m,mode=0700,uid={uid},gid={uid}")


def apply_limits(cfg):
    mib = 1024 * 1024
    lim = cfg["limits"]
    for res, value in ((resource.RLIMIT_AS, lim["memory_mb"] * mib), (resource.RLIMIT_FSIZE, lim["fsize_mb"] * mib),
                       (resource.RLIMIT_NOFILE, 64), (resource.RLIMIT_CORE, 0)):
        resource.setrlimit(res, (value, value))
    resource.setrlimit(resource.RLIMIT_CPU, (lim["cpu_s"], lim["cpu_s"] + 1))
    resource.setrlimit(resource.RLIMIT_NPROC, (lim["max_processes"], lim["max_processes"]))
    if cfg["uid"] is not None:
        os.setgroups([])
        os.setgid(cfg["uid"])
        os.setuid(cfg["uid"])


def make_guard(root, violations, deny_processes):
    write_flags = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC

    def inside(path):
        real = os.path.realpath(os.fsdecode(path))
        return real == root or real.startswith(root + os.sep) or real == os.devnull

    def deny(kind, what):
        violations.append([kind, str(what)[:200]])
        raise PermissionError(f"sandbox: {what} is not allowed")

    def hook(event, args):
        if event == "open":
            path, mode, flags = args
            if isinstance(path, (str, bytes, os.PathLike)) and (
                    (mode and any(c in mode for c in "wax+")) or (isinstance(flags, int) and flags & write_flags)):
                if not inside(path):
                    deny("write", f"writing {os.fsdecode(path)!r} outside the sandbox directory")
        elif event in WRITE_EVENTS:
            for path in args[:2]:
                if isinstance(path, (str, bytes, os.PathLike)) and not inside(path):
                    deny("write", f"{event} on {os.fsdecode(path)!r} outside the sandbox directory")
        elif event in NET_EVENTS:
            deny("network", f"network access ({event})")
        elif deny_processes and event in PROC_EVENTS:
            deny("process", f"starting processes ({event}) without a process limit")

    return hook


def classify(exc, violations):
    if violations:
        return {"write": "write_blocked", "network": "network_blocked", "process": "process_limit"}[violations[0][0]]
    if isinstance(exc, MemoryError):
        return "memory_limit"
    if isinstance(exc, BlockingIOError) or (isinstance(exc, OSError) and exc.errno == 11):
        return "process_limit"
    if isinstance(exc, OSError) and exc.errno in (101, 111, 113, -2, -3):  # unreachable/refused/no DNS
        return "network_blocked"
    if isinstance(exc, OSError) and exc.errno in (30, 13):  # EROFS, EACCES
        return "write_blocked"
    if isinstance(exc, SyntaxError):
        return "syntax_error"
    if isinstance(exc, AssertionError):
        return "tests_failed"
    return "error"


def run_tests(cfg, report):
    violations = []
    sys.addaudithook(make_guard(os.path.realpath(cfg["dir"]), violations, cfg["deny_processes"]))
    ns = {"__name__": "solution", "__builtins__": __builtins__}
    passed, total, failures = 0, 0, []
    try:
        exec(compile(cfg["program"], os.path.join(cfg["dir"], "solution.py"), "exec"), ns)
        tests = ast.parse(cfg["tests"], "tests.py").body
    except BaseException as exc:  # noqa: BLE001 - any failure of the candidate is reported, not raised
        return report(stage="program", reason=classify(exc, violations), exc=_fmt(exc),
                      tb=traceback.format_exc(limit=-3), violations=violations)
    for node in tests:
        is_test = isinstance(node, ast.Assert)
        total += is_test
        try:
            exec(compile(ast.Module([node], []), "tests.py", "exec"), ns)
            passed += is_test
        except BaseException as exc:  # noqa: BLE001
            failures.append({"line": node.lineno, "reason": classify(exc, violations), "exc": _fmt(exc)})
            if not isinstance(exc, AssertionError):
                break
    reason = failures[0]["reason"] if failures else ("passed" if total else "no_tests")
    return report(stage="tests", reason=reason, passed=passed, total=total, failures=failures[:5],
                  violations=violations)


def _fmt(exc):
    return f"{type(exc).__name__}: {exc}"[:500]


def runner(cfg, status_fd):
    me = os.getpid()

    def report(**fields):
        if os.getpid() == me:  # forked copies of the program never report
            for stream in (sys.stdout, sys.stderr):  # os._exit below would drop buffered output
                try:
                    stream.flush()
                except Exception:  # noqa: BLE001 - the program may have closed or replaced them
                    pass
            line = json.dumps({"kind": "result", "nonce": cfg["nonce"], **fields})[:20000]
            os.write(status_fd, line.encode() + b"\n")

    try:
        apply_limits(cfg)
        os.chdir(cfg["dir"])
        os.umask(0o077)
        run_tests(cfg, report)
    except BaseException as exc:  # noqa: BLE001
        report(stage="setup", reason="sandbox_error", exc=_fmt(exc))
    finally:
        os._exit(0)


def main():
    cfg = json.loads(sys.stdin.read())
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    status_fd = cfg["status_fd"]
    if cfg["mounts"]:
        isolate_filesystem(cfg)
    path = os.path.join(cfg["dir"], "solution.py")
    with open(path, "w") as f:
        f.write(cfg["program"])
    if cfg["uid"] is not None:
        os.chown(path, cfg["uid"], cfg["uid"])
        os.chown(cfg["dir"], cfg["uid"], cfg["uid"])
    pid = os.fork()
    if pid == 0:
        runner(cfg, status_fd)
    while True:  # as pid 1 we also reap orphans; stop when our runner is done
        got, status, usage = os.wait4(-1, 0)
        if got == pid:
            break
    line = {"kind": "exit", "nonce": cfg["nonce"], "code": os.WEXITSTATUS(status) if os.WIFEXITED(status) else None,
            "signal": os.WTERMSIG(status) if os.WIFSIGNALED(status) else None,
            "cpu_s": round(usage.ru_utime + usage.ru_stime, 3)}
    os.write(status_fd, json.dumps(line).encode() + b"\n")
    os._exit(0)


if __name__ == "__main__":
    main()
