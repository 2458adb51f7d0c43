"""`areal-mq worker echo`: a simulated diagnostic worker (named as such) with no model.

What: serves RewardJob on service "echo" (AREAL_ECHO_SERVICE), rewarding each completion with its length.
Why: lets users check a deployment (broker reachable, routing, heartbeats) without a model, and the
integration tests kill it mid-job to prove requeueing. It is a simulated worker, named as such.
Run: AREAL_ECHO_DELAY_S=0.5 areal-mq worker echo --config configs/quickstart.yaml
"""
from __future__ import annotations

import os
import time
from typing import Any

from areal_mq.messages import RewardJob, RewardResult
from areal_mq.actor.roles import Role, RoleLoop


class Echo(Role):
    name = "echo"
    drain_timeout_s = 0.0

    def __init__(self, rt: Any, delay_s: float):
        super().__init__(rt)
        self.delay_s = delay_s

    def on_job(self, job: Any) -> None:
        if not isinstance(job.msg, RewardJob):
            self.rt.fail(job, "bad_request", f"echo worker takes reward_job, got {job.msg.kind.value}")
            return
        if self.delay_s:
            time.sleep(self.delay_s)
        self.rt.reply(job, RewardResult(rewards=[float(len(c)) for c in job.msg.completions],
                                        worker_id=self.rt.worker_id))
        self.log.info("echo.job_done", job=job.id)


def main(cfg: Any, worker_id: str | None = None) -> int:
    from areal_mq.actor.runtime import WorkerRuntime

    delay = float(os.environ.get("AREAL_ECHO_DELAY_S", "0"))
    capacity = int(os.environ.get("AREAL_ECHO_CAPACITY", "1"))
    service = os.environ.get("AREAL_ECHO_SERVICE", "echo")
    rt = WorkerRuntime(cfg, role="echo", service=service, capacity=capacity, worker_id=worker_id)
    rt.start(wait_weights_s=2.0)
    rt.ready()
    rt.log.info("echo.started", service=service, capacity=capacity, delay_s=delay)
    try:
        RoleLoop(rt, Echo(rt, delay)).run()
    finally:
        rt.close()
    return 0
