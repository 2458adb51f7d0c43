"""A memory cgroup for one sandboxed run, where this host lets the reward worker create one.

What: `RunCgroup.create(memory_mb)` makes a fresh cgroup whose memory (swap included) is capped at memory_mb,
or returns None. The sandbox's boot process joins it (writes "0" to `procs`) before the program starts, so
the cap holds for the whole process tree; `oom_killed()` says whether the kernel killed a process of the run
for it; `remove()` kills what is left in it and deletes it.
Why: rlimits bound one process (RLIMIT_AS) and the number of processes (RLIMIT_NPROC), so without a cgroup a
tree of processes may use up to memory_mb x max_processes. A cgroup bounds the sum.
Where: cgroup v2 when the worker's own cgroup already enables `memory` for its children (the root cgroup,
or a subtree delegated to the worker: we never change a parent's `cgroup.subtree_control`); else the memory
hierarchy of cgroup v1 (the worker's own memory cgroup). Creating one needs write access there (root, or
delegation); without it, None, and the rlimits bound is what holds (SandboxResult.memory_bound says which).
Run: python -c "from areal_mq.rewards.sandbox.cgroup import RunCgroup; print(RunCgroup.create(64))"
"""
from __future__ import annotations

import os
import secrets
import signal
import time
from dataclasses import dataclass

# per version: file capping memory, file capping memory+swap (value) or swap (0), file with the oom_kill count
FILES = {2: ("memory.max", "memory.swap.max", "memory.events"),
         1: ("memory.limit_in_bytes", "memory.memsw.limit_in_bytes", "memory.oom_control")}


def _unescape(path: str) -> str:
    return path.encode().decode("unicode_escape")


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


def _write(path: str, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


def candidates() -> list[tuple[int, str]]:
    """(version, directory) of cgroups under which this process may try to create a memory-capped child."""
    own = {}
    for line in _read("/proc/self/cgroup").splitlines():
        _, controllers, path = line.split(":", 2)
        for c in controllers.split(",") if controllers else [""]:
            own[c] = path
    found = []
    for line in _read("/proc/self/mountinfo").splitlines():
        left, _, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if len(fields) < 5 or len(tail) < 3:
            continue
        root, point, fstype, opts = _unescape(fields[3]), _unescape(fields[4]), tail[0], tail[2].split(",")
        version = 2 if fstype == "cgroup2" else 1 if fstype == "cgroup" and "memory" in opts else 0
        mine = own.get("" if version == 2 else "memory")
        if not version or mine is None or not (mine == root or mine.startswith(root.rstrip("/") + "/")):
            continue
        directory = os.path.join(point, os.path.relpath(mine, root))
        if version == 2 and "memory" not in _read(os.path.join(directory, "cgroup.subtree_control")).split():
            continue
        found.append((version, os.path.normpath(directory)))
    return sorted(found, reverse=True)  # v2 first


@dataclass
class RunCgroup:
    version: int
    path: str

    @property
    def procs(self) -> str:
        """The file a process writes "0" to in order to join."""
        return os.path.join(self.path, "cgroup.procs")

    @classmethod
    def create(cls, memory_mb: int) -> RunCgroup | None:
        """A fresh cgroup capped at memory_mb, or None where this host does not let us make one."""
        for version, parent in candidates():
            if not os.access(parent, os.W_OK):
                continue
            group = cls(version, os.path.join(parent, f"areal-sbx-{secrets.token_hex(6)}"))
            try:
                os.mkdir(group.path, 0o755)
            except OSError:
                continue
            limit, swap, _ = FILES[version]
            try:
                _write(os.path.join(group.path, limit), str(memory_mb * 1024 * 1024))
                swap_path = os.path.join(group.path, swap)
                if os.path.exists(swap_path):
                    _write(swap_path, "0" if version == 2 else str(memory_mb * 1024 * 1024))
                return group
            except OSError:
                group.remove()
        return None

    def oom_killed(self) -> bool:
        """Whether the kernel killed a process of this cgroup for exceeding the cap."""
        for line in _read(os.path.join(self.path, FILES[self.version][2])).splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill" and value.strip().isdigit():
                return int(value) > 0
        return False

    def remove(self) -> None:
        """Kill every process left in the cgroup, then delete it (best effort; never raises)."""
        kill = os.path.join(self.path, "cgroup.kill")
        for _ in range(200):
            pids = [int(p) for p in _read(self.procs).split() if p.isdigit()]
            if not pids:
                try:
                    os.rmdir(self.path)
                    return
                except FileNotFoundError:
                    return
                except OSError:  # EBUSY: a process is still exiting
                    time.sleep(0.01)
                    continue
            if os.path.exists(kill):  # v2 (5.14+): the kernel kills them all, also those forking right now
                try:
                    _write(kill, "1")
                except OSError:
                    pass
            sigkill_all(pids)


def sigkill_all(pids) -> None:
    """SIGKILL each pid (gone or not ours: ignored), then give the kernel 10 ms to reap them."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    time.sleep(0.01)
