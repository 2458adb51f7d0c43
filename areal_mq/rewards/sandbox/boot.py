"""Inside the code sandbox: isolate, drop privileges, run a candidate program and its tests' parts, report.

Stdlib only: started by areal_mq.rewards.sandbox.runner as `python -I -S -B boot.py` (in namespace mode
under `unshare --net --ipc --mount --pid --fork --kill-child --mount-proc`), with a JSON config on stdin.
Not meant to be run by hand.

Two processes:
  boot (root, pid 1 of the pid namespace): joins the run's memory cgroup when there is one, hides the host
      temp and run directories under empty tmpfs (mode 0000; Python, where it lies below one, is bind-mounted
      beside the sandbox dir and its paths moved there), makes every mount read-only, mounts a small private tmpfs on the sandbox
      directory, writes the program there, forks the runner, waits for it and writes an "exit" line (exit
      code, signal, CPU seconds) on the status pipe. When boot exits the kernel kills whatever the program
      left behind in the namespace.
  runner: sets rlimits (CPU, address space, processes, file size, open files), switches to a fresh
      unprivileged uid, sets PR_SET_NO_NEW_PRIVS, loads a seccomp filter (libseccomp: native arch only,
      other ABIs killed) that refuses new namespaces, mounts, ptrace, SysV IPC and other kernel-level calls,
      installs an audit hook that refuses sockets and writes outside the directory (and names the reason
      of what the kernel refused), runs the program, then the test steps: setup statements, and probes
      whose parts (program-facing expressions) it evaluates and writes back as plain data ("probe" lines).
The runner never decides whether a test passed: areal_mq/rewards/sandbox/assert_judge.py rebuilds each assert from
the values in the reward worker; the expected values of the asserts never enter this process.
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


def _under(path, top):
    return path.startswith(top.rstrip("/") + "/")


def _covers(cfg, keep):
    """Directories to hide: the masks, plus each ancestor of a kept path that other users cannot enter
    (e.g. /root, 0700, above a pyenv Python). Shallow first: a cover inside an earlier one is already gone."""
    out = list(cfg["mask"])
    for path in keep:
        cur = "/"
        for part in path.strip("/").split("/")[:-1]:
            cur = os.path.join(cur, part)
            if not os.stat(cur).st_mode & stat.S_IXOTH:
                out.append(cur)
                break
    return sorted(set(out), key=lambda p: p.count("/"))


def isolate_filesystem(cfg):
    """Hide the covers under empty root-owned tmpfs (mode 0000: nothing below can even be looked up, so every
    access is EACCES), make every mount read-only, and mount the sandbox dir: a private size-limited tmpfs, the
    only writable place.

    Python itself may live under a cover (a venv under /tmp, a pyenv under /root). It is not put back in place:
    a cover with something put back must be traversable, and then every other name below it answers ENOENT
    instead of EACCES, so a program reading a hidden host file got `error` instead of `read_blocked`. Instead
    each such kept directory is bind-mounted at `<dir>.py/<i>` (beside the sandbox dir, outside every cover)
    and the interpreter's own paths are moved there (relocate_python): every cover stays 0000 wherever the
    interpreter lives."""
    libc = ctypes.CDLL(None, use_errno=True)
    keep = sorted({os.path.realpath(p) for p in cfg["expose"]})
    covers = _covers(cfg, keep)
    moved = {}
    buried = [p for p in keep if any(p == c or _under(p, c) for c in covers)]
    buried = [p for p in buried if not any(_under(p, q) for q in buried)]  # the outermost of nested ones
    if buried:
        base = cfg["dir"] + ".py"
        os.makedirs(base, mode=0o711, exist_ok=True)
        for i, path in enumerate(buried):
            moved[path] = os.path.join(base, str(i))
            os.makedirs(moved[path], mode=0o711, exist_ok=True)
            _mount(libc, path, moved[path], None, MS_BIND | MS_REC, None)
    renames = python_paths(moved)
    for point in covers:
        if not os.path.isdir(point):
            continue
        inner = [p for p in [cfg["dir"]] if _under(p, point)]  # the sandbox dir normally lies outside every cover
        _mount(libc, "tmpfs", point, "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC,
               f"size=1m,mode={'0711' if inner else '0000'}")
        for path in inner:
            os.makedirs(path, mode=0o711, exist_ok=True)
    relocate_python(renames)  # before anything imports lazily again (the codecs _mounts needs, say)
    for point, opts, fstype in list(_mounts()):
        if fstype in SKIP_FS or "ro" in opts or point.startswith(("/proc", "/sys")):
            continue
        extra = sum(flag for name, flag in (("nosuid", MS_NOSUID), ("nodev", MS_NODEV), ("noexec", MS_NOEXEC))
                    if name in opts)
        _mount(libc, None, point, None, MS_REMOUNT | MS_BIND | MS_RDONLY | extra, None)
    uid = cfg["uid"] if cfg["uid"] is not None else 0
    _mount(libc, "tmpfs", cfg["dir"], "tmpfs", MS_NOSUID | MS_NODEV,
           f"size={cfg['disk_mb']}m,mode=0700,uid={uid},gid={uid}")


def python_paths(moved):
    """{path Python uses: where it will be} for the interpreter's search paths and prefixes that lie in a moved
    directory (resolved now, while the old places still resolve)."""
    used = [*sys.path, sys.prefix, sys.exec_prefix, sys.base_prefix, sys.base_exec_prefix]
    for mod in list(sys.modules.values()):
        path = getattr(mod, "__path__", None)
        if isinstance(path, list):
            used.extend(p for p in path if isinstance(p, str))
    out = {}
    for p in used:
        real = os.path.realpath(p)
        for old, new in moved.items():
            if real == old or _under(real, old):
                out[p] = new + real[len(old):]
    return out


def relocate_python(renames):
    """Point sys.path, the prefixes and the packages already imported at the relocated copies."""
    if not renames:
        return
    sys.path[:] = [renames.get(p, p) for p in sys.path]
    for name in ("prefix", "exec_prefix", "base_prefix", "base_exec_prefix"):
        setattr(sys, name, renames.get(getattr(sys, name), getattr(sys, name)))
    for mod in list(sys.modules.values()):
        path = getattr(mod, "__path__", None)
        if isinstance(path, list):
            path[:] = [renames.get(p, p) for p in path]
    sys.path_importer_cache.clear()


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


SECCOMP_DENY = ("unshare", "setns", "mount", "umount2", "pivot_root", "chroot", "ptrace", "process_vm_readv",
                "process_vm_writev", "kexec_load", "kexec_file_load", "init_module", "finit_module", "delete_module",
                "bpf", "perf_event_open", "keyctl", "add_key", "request_key", "userfaultfd", "open_by_handle_at",
                "name_to_handle_at", "fsopen", "fsmount", "fsconfig", "move_mount", "open_tree", "fspick",
                "mount_setattr", "swapon", "swapoff", "reboot", "settimeofday", "clock_settime", "acct",
                "quotactl", "syslog", "iopl", "ioperm", "personality", "shmget", "shmat", "semget", "msgget")
# CLONE_NEWUSER, NEWNS, NEWNET, NEWPID, NEWIPC, NEWUTS, NEWCGROUP
CLONE_NS_FLAGS = (0x10000000, 0x00020000, 0x40000000, 0x20000000, 0x08000000, 0x04000000, 0x02000000)


class _ArgCmp(ctypes.Structure):  # struct scmp_arg_cmp
    _fields_ = [("arg", ctypes.c_uint), ("op", ctypes.c_int), ("datum_a", ctypes.c_uint64),
                ("datum_b", ctypes.c_uint64)]


def install_seccomp():
    """Refuse (EPERM) the syscalls of SECCOMP_DENY and clone() with any CLONE_NEW* flag; clone3 gets ENOSYS
    (its flags live in memory a filter cannot read; libc then falls back to clone). Raises when libseccomp is
    missing or the filter does not load: the caller fails closed."""
    lib = ctypes.CDLL("libseccomp.so.2", use_errno=True)
    lib.seccomp_init.restype, lib.seccomp_init.argtypes = ctypes.c_void_p, [ctypes.c_uint32]
    lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
    lib.seccomp_rule_add_array.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int, ctypes.c_uint,
                                           ctypes.POINTER(_ArgCmp)]
    lib.seccomp_load.argtypes = [ctypes.c_void_p]
    allow, errno_of = 0x7FFF0000, (lambda e: 0x00050000 | e)
    ctx = lib.seccomp_init(allow)
    if not ctx:
        raise OSError("seccomp_init failed")

    def rule(name, action, cmp=None):
        nr = lib.seccomp_syscall_resolve_name(name.encode())
        if nr < 0:
            return  # not a syscall on this architecture
        n = 0 if cmp is None else 1
        arr = (_ArgCmp * 1)(cmp) if cmp is not None else None
        if lib.seccomp_rule_add_array(ctx, action, nr, n, arr) != 0:
            raise OSError(f"seccomp rule for {name} failed")

    for name in SECCOMP_DENY:
        rule(name, errno_of(1))
    for flag in CLONE_NS_FLAGS:  # SCMP_CMP_MASKED_EQ (7): (flags & flag) == flag; rules of one syscall OR together
        rule("clone", errno_of(1), _ArgCmp(0, 7, flag, flag))
    rule("clone3", errno_of(38))
    if lib.seccomp_load(ctx) != 0:
        raise OSError("seccomp_load failed")


def encode_value(v, depth=0, budget=None):
    """A plain value as tagged JSON for the judge (exact builtin types only: a subclass with a custom
    __eq__ must not pass for an int). Raises TypeError for anything else."""
    budget = budget if budget is not None else [100_000]
    budget[0] -= 1
    if budget[0] < 0 or depth > 20:
        raise TypeError("value too large or too deep to send")
    t = type(v)
    if v is None:
        return {"n": None}
    if t is bool:
        return {"b": v}
    if t is int:
        return {"i": v} if abs(v) < 1 << 63 else {"x": hex(v)}  # hex: no decimal digit limit
    if t is float:
        return {"f": v if v == v and v not in (float("inf"), float("-inf")) else repr(v)}
    if t is str:
        return {"s": v[:100_000]}
    if t is bytes:
        return {"y": v[:50_000].hex()}
    if t in (list, tuple, set, frozenset):
        tag = {list: "l", tuple: "t", set: "set", frozenset: "fset"}[t]
        return {tag: [encode_value(x, depth + 1, budget) for x in v]}
    if t is dict:
        return {"d": [[encode_value(k, depth + 1, budget), encode_value(x, depth + 1, budget)] for k, x in v.items()]}
    raise TypeError(f"a {t.__name__} is not a plain value (int, float, bool, str, bytes, None, list, tuple, "
                    "dict, set)")


def make_guard(root, violations, deny_processes, seen):
    """Audit hook: refuses sockets, writes outside `root` and (deny_processes) new processes, recording each in
    `violations`; remembers in seen["read"] the last path opened or listed for reading (to name an EACCES)."""
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
            if not isinstance(path, (str, bytes, os.PathLike)):
                return
            if (mode and any(c in mode for c in "wax+")) or (isinstance(flags, int) and flags & write_flags):
                if not inside(path):
                    deny("write", f"writing {os.fsdecode(path)!r} outside the sandbox directory")
            else:
                seen["read"] = os.fsdecode(path)
        elif event in ("os.listdir", "os.scandir") and isinstance(args[0], (str, bytes)):
            seen["read"] = os.fsdecode(args[0])
        elif event in WRITE_EVENTS:
            for path in args[:2]:
                if isinstance(path, (str, bytes, os.PathLike)) and not inside(path):
                    deny("write", f"{event} on {os.fsdecode(path)!r} outside the sandbox directory")
        elif event in NET_EVENTS:
            deny("network", f"network access ({event})")
        elif deny_processes and event in PROC_EVENTS:
            deny("process", f"starting processes ({event}) without a process limit")

    return hook


def classify(exc, violations, seen=None):
    """The reason code of an exception the program or a test part raised."""
    if violations:
        return {"write": "write_blocked", "network": "network_blocked", "process": "process_limit"}[violations[0][0]]
    if isinstance(exc, MemoryError):
        return "memory_limit"
    if isinstance(exc, BlockingIOError) or (isinstance(exc, OSError) and exc.errno == 11):
        return "process_limit"
    if isinstance(exc, OSError) and exc.errno in (101, 111, 113, -2, -3):  # unreachable/refused/no DNS
        return "network_blocked"
    if isinstance(exc, OSError) and exc.errno == 13 and exc.filename is not None and seen and \
            os.fsdecode(exc.filename) == seen.get("read"):  # EACCES reading: a hidden host directory
        return "read_blocked"
    if isinstance(exc, OSError) and exc.errno in (30, 13):  # EROFS, EACCES (for a ctypes call: no filename)
        return "write_blocked"
    if isinstance(exc, OSError) and exc.errno in (1, 3, 38):  # EPERM (seccomp, another user's process), ESRCH
        # (a process outside the pid namespace is invisible), ENOSYS (clone3)
        return "syscall_blocked"
    if isinstance(exc, TypeError) and "is not a plain value" in str(exc):
        return "bad_result_type"
    if isinstance(exc, SyntaxError):
        return "syntax_error"
    if isinstance(exc, AssertionError):
        return "tests_failed"
    return "error"


def run_steps(cfg, send):
    """The program, then the test steps; each probe's values (or its error) go back as one line."""
    violations, seen = [], {}
    sys.addaudithook(make_guard(os.path.realpath(cfg["dir"]), violations, cfg["deny_processes"], seen))
    ns = {"__name__": "solution", "__builtins__": __builtins__}
    try:
        exec(compile(cfg["program"], os.path.join(cfg["dir"], "solution.py"), "exec"), ns)
    except BaseException as exc:  # noqa: BLE001 - any failure of the candidate is reported, not raised
        return send(kind="stopped", stage="program", line=0, reason=classify(exc, violations, seen), exc=_fmt(exc))
    for step in cfg["steps"]:
        if step["kind"] == "exec":
            try:
                exec(compile(step["src"], "tests.py", "exec"), ns)
            except BaseException as exc:  # noqa: BLE001
                return send(kind="stopped", stage="tests", line=step["line"], reason=classify(exc, violations, seen),
                            exc=_fmt(exc))
            continue
        entries, fatal = [], None
        for expr in step["exprs"]:  # every part, in order; the judge decides which ones it needs
            if fatal:
                entries.append(fatal)
                continue
            try:
                entries.append(encode_value(eval(compile(expr, "tests.py", "eval"), ns)))
            except BaseException as exc:  # noqa: BLE001
                entries.append({"err": _fmt(exc), "why": classify(exc, violations, seen)})
                if not isinstance(exc, (AssertionError, TypeError, ValueError, ArithmeticError, LookupError,
                                        AttributeError, NameError)):
                    fatal = entries[-1]  # e.g. MemoryError or a blocked action: nothing after it runs
        send(kind="probe", id=step["id"], values=entries)
        if fatal:
            return send(kind="stopped", stage="tests", line=step["line"], reason=fatal["why"], exc=fatal["err"])
    return send(kind="done")


def _fmt(exc):
    return f"{type(exc).__name__}: {exc}"[:500]


def runner(cfg, status_fd):
    me = os.getpid()

    def send(**fields):
        if os.getpid() == me:  # forked copies of the program never report
            for stream in (sys.stdout, sys.stderr):  # os._exit below would drop buffered output
                try:
                    stream.flush()
                except Exception:  # noqa: BLE001 - the program may have closed or replaced them
                    pass
            line = json.dumps({"nonce": cfg["nonce"], **fields})
            if len(line) >= 400_000:
                too_large = {"err": "value too large to send", "why": "bad_result_type"}
                line = json.dumps({"nonce": cfg["nonce"], "kind": "probe", "id": fields.get("id"),
                                   "values": [too_large] * len(fields.get("values", ()))})
            os.write(status_fd, line.encode() + b"\n")

    try:
        apply_limits(cfg)
        if cfg["seccomp"]:
            ctypes.CDLL(None).prctl(38, 1, 0, 0, 0)  # PR_SET_NO_NEW_PRIVS: no setuid binary gives privileges back
            install_seccomp()
        os.chdir(cfg["dir"])
        os.umask(0o077)
    except BaseException as exc:  # noqa: BLE001 - fail closed: nothing of the program runs
        send(kind="stopped", stage="setup", line=0, reason="sandbox_error", exc=_fmt(exc))
        os._exit(0)
    try:
        run_steps(cfg, send)
    finally:
        os._exit(0)


def main():
    cfg = json.loads(sys.stdin.read())
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    status_fd = cfg["status_fd"]
    if cfg["cgroup_procs"]:  # the cap then holds for everything the program starts; raises (fail closed)
        with open(cfg["cgroup_procs"], "w") as f:
            f.write("0")
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
