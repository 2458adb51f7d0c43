"""What runs on a Ray node before a role is placed there, and how a Ray error is said in one line: shared by the
backend (ray_backend.py: where the brokers' anchor lives) and the trainer unit (ray_unit.py: where each rank lands).
"""
from __future__ import annotations

from typing import Any

from areal_mq.launch.ports import PORT_NAMES, settle_ports


def probe_node(cfg: Any = None) -> dict:
    """Runs as a Ray task where an anchor will live: the node's id and IP, and (given a config) four free
    consecutive broker ports on that IP (the local launcher's rule)."""
    import ray

    out = {"node_id": ray.get_runtime_context().get_node_id(), "ip": ray.util.get_node_ip_address()}
    if cfg is not None:
        cfg.brokers.host = out["ip"]
        settle_ports(cfg)
        out["ports"] = {name: getattr(cfg.brokers, name) for name in PORT_NAMES}
    return out


def first_line(exc: BaseException) -> str:
    """An exception's first line (at most 300 characters), or its type's name when it says nothing."""
    text = str(exc).strip()
    return text.splitlines()[0][:300] if text else type(exc).__name__
