"""The job-broker links of a swarm process (workers/swarm.py): one WorkerLink per simulated worker, and answerers.

What: `swarm_link` builds the link of one simulated worker: areal_mq/actor/link.py's WorkerLink, the same
READY / heartbeat / reconnect state machine the worker runtime drives for a real worker, over its own DEALER
(its own identity), with a log bound to its worker id. A RolloutWorker takes it as its runtime (worker_id, log,
keys, capacity, reply, fail). The swarm drives every link from its one thread, so the broker sees N
independent workers that cost one process.
`Responder` links serve another service with an instant answer: the simulated reward (Bernoulli(0.5) per
completion) and the dispatch-latency probe (a GenerateRequest whose group_id carries its send time;
the latency client -> broker -> worker is recorded, the answer is an Error the client ignores).
"""
from __future__ import annotations

import time
from typing import Any, Callable

import numpy as np
import zmq

from areal_mq.actor.link import Job, WorkerLink
from areal_mq.messages import Error, GenerateRequest, RewardJob, RewardResult

PROBE_PREFIX = "probe:"  # GenerateRequest.group_id of a dispatch-latency probe: "probe:<time.time()>"


def swarm_link(ctx: zmq.Context, cfg: Any, keys: Any, log: Any, worker_id: str, service: str, capacity: int,
               role: str = "rollout") -> WorkerLink:
    """One simulated worker's open link (its log events are `swarm.*`, bound to its worker id)."""
    log = log.bind(worker_id=worker_id) if hasattr(log, "bind") else log
    link = WorkerLink(ctx, cfg.brokers, keys, worker_id, role=role, service=service, capacity=capacity, log=log,
                      event_prefix="swarm")
    link.open()
    return link


class Responder:
    """A link that answers its jobs at once with `answer(job) -> message | None` (None: no reply)."""

    def __init__(self, link: WorkerLink, answer: Callable[[Job], Any]):
        self.link, self.answer = link, answer

    def serve(self) -> None:
        for job in self.link.receive():
            msg = self.answer(job)
            if msg is not None:
                self.link.reply(job, msg)


def sim_reward(seed: int, worker_id: str) -> Callable[[Job], Any]:
    """Answer a RewardJob with a Bernoulli(0.5) reward per completion (instant: rewards are not the GPUs)."""
    rng = np.random.default_rng(seed)

    def answer(job: Job) -> Any:
        if not isinstance(job.msg, RewardJob):
            return Error(code="bad_request", message=f"the simulated reward takes reward_job, got {job.msg.kind.value}",
                         ref_id=job.id)
        n = len(job.msg.completions)
        return RewardResult(rewards=rng.integers(0, 2, n).astype(float).tolist(), errors=[None] * n,
                            worker_id=worker_id)
    return answer


def probe_answer(latencies: list[tuple[float, float]]) -> Callable[[Job], Any]:
    """Record (receive wall time, client -> broker -> worker latency) of a probe (its send time is in group_id)."""
    def answer(job: Job) -> Any:
        msg = job.msg
        if isinstance(msg, GenerateRequest) and msg.group_id.startswith(PROBE_PREFIX):
            now = time.time()
            latencies.append((round(now, 4), now - float(msg.group_id[len(PROBE_PREFIX):])))
        return Error(code="probe", message="dispatch probe answered", ref_id=job.id)
    return answer
