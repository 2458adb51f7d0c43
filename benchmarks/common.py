"""Small helpers every benchmark script shares: loopback ports, process CPU time, machine description.

Imported as a sibling module (`import common`): the scripts are run as `python benchmarks/NAME.py`, which puts
this directory first on sys.path.
"""
from __future__ import annotations

import os
import platform
import socket


def free_ports(n: int) -> list[int]:
    """n distinct free TCP ports on 127.0.0.1 (all held open together, so they differ)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process (fields 14 and 15 of /proc/PID/stat); 0 if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(l.split(":", 1)[1].strip() for l in f if l.startswith("model name"))
    except (OSError, StopIteration):
        return ""


def machine(**extra) -> dict:
    """What the numbers were measured on: CPUs, CPU model, platform, Python, load average at start, plus
    whatever the benchmark adds (library versions, model, dtype)."""
    return {"cpus": os.cpu_count(), "cpu_model": cpu_model(), "platform": platform.platform(),
            "python": platform.python_version(), **extra, "loadavg_at_start": list(os.getloadavg())}
