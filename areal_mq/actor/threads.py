"""CPU thread budget per role: the launcher divides the machine's cores between processes.

`launcher.threads` maps a role to its torch intra-op threads (e.g. {rollout: 1, trainer: 1}); a role not
listed keeps torch's default. Applied once at process start, before any model is built.
"""
from __future__ import annotations

import os
from typing import Any


def apply_thread_budget(cfg: Any, role: str) -> int | None:
    threads = cfg.launcher.threads.get(role)
    if not threads:
        return None
    os.environ["OMP_NUM_THREADS"] = str(threads)
    import torch

    torch.set_num_threads(int(threads))
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:  # already set once in this process
        pass
    return int(threads)
