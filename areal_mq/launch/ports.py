"""The broker ports of `areal-mq run`: a taken one stops the run at once, or moves the brokers to free ports.

What: `claim_broker_ports(cfg)` runs before anything starts (no child, no run directory). When the four broker
ports (brokers.job_port, bus_in_port, bus_out_port, store_port) are free it changes nothing. When one is taken:
  - brokers.auto_ports true, or unset while all four are at their defaults (5555-5558): all four move to a free
    block of consecutive ports (the layout `areal-mq reward serve --broker` relies on) and the returned line says
    where, for `areal-mq run` to print;
  - otherwise (ports the user named, or auto_ports false): PortInUse, a ConfigError (exit 2) naming each taken port,
    what holds it when /proc tells (pid and command line of a process this user may inspect), the --set that
    moves the brokers to ports free right now, and --set brokers.auto_ports=true.
Why: a second run on one host must not collide with the first, and ports a user named (for workers on other hosts,
an external reward worker) are never moved behind their back.
A port counts as taken when a socket with SO_REUSEADDR (as ZeroMQ binds) cannot bind it: a listener, not the
TIME_WAIT connections a finished run leaves behind.
Run: tests/unit/launch/test_ports.py holds ports with real sockets.
"""
from __future__ import annotations

import errno
import os
import socket
from pathlib import Path
from typing import Any

from areal_mq.errors import ConfigError

PORT_NAMES = ("job_port", "bus_in_port", "bus_out_port", "store_port")


def port_free(host: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
            return True
        except OSError:
            return False


LOW_PORT = 10000  # where picked ports start: above the well-known and registered services most hosts run
EPHEMERAL = (32768, 60999)  # Linux's default ip_local_port_range, where /proc does not say


def ephemeral_range() -> tuple[int, int]:
    """The kernel's range for outgoing connections' local ports (and for bind to port 0)."""
    try:
        lo, hi = (int(x) for x in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
        return lo, hi
    except (OSError, ValueError):
        return EPHEMERAL


def quiet_span() -> tuple[int, int]:
    """LOW_PORT up to the kernel's ephemeral range; under pytest-xdist (PYTEST_XDIST_WORKER, inherited by every
    process a test starts) this worker's own slice of it, so two test workers (and the runs, benchmarks and fuzz
    targets they start) never draw the same port."""
    lo, hi = LOW_PORT, ephemeral_range()[0]
    worker, count = os.environ.get("PYTEST_XDIST_WORKER", ""), os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")
    if worker.startswith("gw") and worker[2:].isdigit() and count.isdigit() and int(count) > 1:
        size = (hi - lo) // int(count)
        lo += int(worker[2:]) * size
        hi = lo + size
    return lo, hi


def quiet_ports(host: str, n: int, span: tuple[int, int] | None = None) -> list[int]:
    """`n` distinct ports free on `host` now, drawn at random from `span` (default: LOW_PORT up to the kernel's
    ephemeral range). Why not bind to port 0: the kernel draws those from the ephemeral range, the same range it
    gives every outgoing connection, so between choosing a port and binding it any process's connect() may take it
    (seen: a test's broker port taken by a trainer's connection while two test runs shared a host). Below that
    range only a process binding that very port can, and a random draw makes two pickers colliding unlikely."""
    lo, hi = span or quiet_span()
    if hi - lo < 8 * n:  # a machine whose ephemeral range starts low: the kernel's own choice
        lo, hi = 0, 0
    import random

    draw = random.SystemRandom()
    socks: list[socket.socket] = []
    try:
        for _ in range(100 * n):
            if len(socks) == n:
                break
            s = socket.socket()
            try:
                s.bind((host, draw.randrange(lo, hi) if hi else 0))
            except OSError:
                s.close()
                continue
            if s.getsockname()[1] in [t.getsockname()[1] for t in socks]:
                s.close()
                continue
            socks.append(s)
        if len(socks) < n:
            raise ConfigError(f"found only {len(socks)} of {n} free ports on {host} in {lo}-{hi}")
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def free_port(host: str) -> int:
    return quiet_ports(host, 1)[0]


def free_port_block(host: str, n: int) -> int:
    """The first of `n` consecutive ports free on `host` (below the ephemeral range: `quiet_ports`)."""
    for _ in range(200):
        base = free_port(host)
        if base + n - 1 < 65536 and all(port_free(host, base + i) for i in range(n)):
            return base
    raise ConfigError(f"no block of {n} free consecutive ports on {host}; set brokers.job_port and the others")


def settle_ports(cfg: Any) -> Any:
    """Keep the configured ports when all four are free; otherwise move all four to a free block of four
    consecutive ports, so the layout stays job, job+1 (bus in), job+2 (bus out), job+3 (store) and a peer given
    only the job address (`areal-mq reward serve --broker`) finds the rest (a second run on one host)."""
    b = cfg.brokers
    if all(port_free(b.host, getattr(b, name)) for name in PORT_NAMES):
        return cfg
    base = free_port_block(b.host, len(PORT_NAMES))
    for i, name in enumerate(PORT_NAMES):
        setattr(b, name, base + i)
    return cfg


class PortInUse(ConfigError):
    """A configured port is taken by another process (another run's broker, most often)."""


def port_taken(host: str, port: int) -> bool:
    """Whether a ZeroMQ-style bind (SO_REUSEADDR) of host:port fails because the port is in use."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return True
            raise ConfigError(f"cannot bind {host}:{port} ({exc.strerror}); is brokers.host an address of this "
                              "host?") from None
    return False


def port_holder(port: int) -> str | None:
    """'pid N: command line' of a process with a TCP socket bound to `port`, from /proc;
    None where that cannot be known (not Linux, another user's process, already gone)."""
    targets = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:  # sl local_address rem_address st ... inode (field 9; 0 for TIME_WAIT)
            f = row.split()
            if len(f) > 9 and f[9] != "0" and int(f[1].rsplit(":", 1)[1], 16) == port:
                targets.add(f"socket:[{f[9]}]")
    if not targets:
        return None
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if any(os.readlink(fd) in targets for fd in (proc / "fd").iterdir()):
                cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
                return f"pid {proc.name}: {cmd[:200] or '?'}"
        except OSError:  # not ours to inspect, or gone
            continue
    return None


def held(port: int) -> str:
    """' (held by pid N: cmd)' or '' for a message."""
    holder = port_holder(port)
    return f" (held by {holder})" if holder else ""


def auto_wanted(brokers: Any) -> bool:
    """brokers.auto_ports, or when unset: whether all four ports are at their defaults (nobody named them)."""
    if brokers.auto_ports is not None:
        return bool(brokers.auto_ports)
    fields = type(brokers).model_fields
    return all(getattr(brokers, name) == fields[name].default for name in PORT_NAMES)


def claim_broker_ports(cfg: Any) -> str | None:
    """Check the broker ports before anything starts; see the module docstring. Returns the line to print when
    the ports moved, None when they stay; PortInUse when one is taken and the ports may not move."""
    b = cfg.brokers
    taken = [name for name in PORT_NAMES if port_taken(b.host, getattr(b, name))]
    if not taken:
        return None
    what = ", ".join(f"brokers.{name} {getattr(b, name)}{held(getattr(b, name))}" for name in taken)
    base = free_port_block(b.host, len(PORT_NAMES))
    if not auto_wanted(b):
        moves = " ".join(f"--set brokers.{name}={base + i}" for i, name in enumerate(PORT_NAMES))
        raise PortInUse(f"{what} on {b.host}: in use (another run on this host?). Move this run's brokers to ports "
                        f"free now with {moves}, or let the launcher pick free ones with "
                        "--set brokers.auto_ports=true")
    for i, name in enumerate(PORT_NAMES):
        setattr(b, name, base + i)
    return (f"brokers: {what} in use, so this run's brokers use job {base}, signal bus {base + 1} (in) / "
            f"{base + 2} (out), sample store {base + 3} on {b.host} (brokers.auto_ports); a worker started by "
            f"hand joins with --config {cfg.run.run_dir}/config.yaml")
