"""`areal-mq worker reward`: serve RewardJobs (service "reward") with the run config's reward section.

What: a WorkerRuntime (broker connection, heartbeats, drain) around a RewardExecutor (pool of
`reward.processes` processes, the worker's capacity). Scoring failures become default rewards and
`reward.error` events naming the job and the exception; SIGTERM or Control(shutdown) drains in-flight jobs.
The loop itself lives in areal_mq.rewards.server so `areal-mq reward serve` shares it.
Run: areal-mq worker reward --config configs/quickstart.yaml [--set reward.processes=2]
"""
from __future__ import annotations

from typing import Any


def main(cfg: Any, worker_id: str | None = None) -> int:
    from areal_mq.rewards.server import run_worker

    return run_worker(cfg, worker_id)
