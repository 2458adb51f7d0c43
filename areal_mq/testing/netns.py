"""Network namespaces for tests and benchmarks that build hosts of their own (tests/integration/test_netns_hosts.py,
the soak's link cuts in benchmarks/faults/soak_faults.py).

- `ip(*args, check=True)`: run iproute2's `ip` (20 s limit), output captured.
- `netns_unavailable()`: why this machine cannot create network namespaces (None when it can): not Linux, not root,
  no `ip`, or `ip netns add` refused (probed with a namespace made and deleted at once).
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=20)


def netns_unavailable() -> str | None:
    """Why network namespaces, veth pairs and bridges cannot be made here (None when they can)."""
    if sys.platform != "linux":
        return "network namespaces are Linux only"
    if os.geteuid() != 0:
        return "needs root to create network namespaces, veth pairs and bridges"
    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) is not installed"
    probe = f"amqprobe{os.getpid()}"
    made = ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    ip("netns", "del", probe, check=False)
    return None
