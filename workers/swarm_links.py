"""The job-broker connections of a swarm process (workers/swarm.py): one DEALER per simulated worker.

What: `SwarmLink` is what a RolloutWorker needs from a WorkerRuntime (worker_id, log, keys, capacity, reply,
fail) over its own DEALER socket, plus the Paranoid Pirate duties the runtime's I/O thread does for a single
worker: READY, a HEARTBEAT every heartbeat_s (client.Liveness, the one rule), READY again once per liveness
window while the broker answers, and a fresh socket when the broker falls silent. The swarm drives every
link from its one thread, so the broker sees N independent workers that cost one process.
`Responder` links serve another service with an instant answer: the simulated reward (Bernoulli(0.5) per
completion) and the dispatch-latency probe (a GenerateRequest whose group_id carries its send time;
the latency client -> broker -> worker is recorded, the answer is an Error the client ignores).
"""
from __future__ import annotations

import time
from typing import Any, Callable

import numpy as np
import zmq

from areal_mq import protocol
from areal_mq.client import Liveness, send
from areal_mq.errors import ProtocolError
from areal_mq.messages import Disconnect, Error, GenerateRequest, Heartbeat, Kind, Ready, RewardJob, RewardResult
from areal_mq.actor.runtime import Job, worker_dealer

PROBE_PREFIX = "probe:"  # GenerateRequest.group_id of a dispatch-latency probe: "probe:<time.time()>"


class SwarmLink:
    """One simulated worker's connection (see the module docstring)."""

    def __init__(self, ctx: zmq.Context, cfg: Any, keys: Any, log: Any, worker_id: str, service: str, capacity: int,
                 role: str = "rollout"):
        self.ctx, self.cfg, self.keys, self.worker_id = ctx, cfg, keys, worker_id
        self.service, self.capacity, self.role = service, capacity, role
        self.log = log.bind(worker_id=worker_id) if hasattr(log, "bind") else log
        b = cfg.brokers
        self.heartbeat_s, self.liveness = b.heartbeat_s, b.liveness
        self.link = Liveness(b.heartbeat_s, b.liveness, b.reconnect_max_s)
        self.max_frame_bytes = int(b.max_frame_mb * (1 << 20))
        self.beats = 0
        self.sock = self._connect()

    def _connect(self) -> zmq.Socket:
        return worker_dealer(self.ctx, self.keys, self.cfg.brokers.job_addr)

    # ------------------------------------------------------------ what a role sees (WorkerRuntime's API)
    def ready(self) -> None:
        send(self.sock, protocol.encode(Ready(service=self.service, capacity=self.capacity, worker_id=self.worker_id,
                                              role=self.role)))

    def reply(self, job: Job, msg: Any) -> None:
        send(self.sock, protocol.encode(msg, reply_to=job.id))

    def fail(self, job: Job, code: str, message: str) -> None:
        self.log.warning(f"{self.role}.job_failed", job=job.id, code=code, error=message)
        self.reply(job, Error(code=code, message=message, ref_id=job.id))

    # ------------------------------------------------------------ I/O, driven by the swarm's loop
    def receive(self) -> list[Job]:
        """Every job waiting on the socket (heartbeat answers and broker errors handled here)."""
        jobs = []
        while True:
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return jobs
            self.link.heard()
            try:
                env = protocol.decode(frames, self.max_frame_bytes)
            except ProtocolError as exc:
                self.log.warning("swarm.bad_job", code=exc.code, error=str(exc))
                if exc.msg_id:
                    send(self.sock, protocol.error_reply(exc))
                continue
            if env.kind == Kind.HEARTBEAT:
                if self.link.restarted(env.msg.peer_id):
                    self.ready()  # a restarted broker knows nobody: announce again
            elif env.kind == Kind.ERROR:
                self.log.warning("swarm.broker_error", code=env.msg.code, error=env.msg.message)
            else:
                jobs.append(Job(env.id, env.msg))

    def beat(self, now: float) -> bool:
        """Heartbeat when due; on a silent broker a fresh socket and READY. True when the socket was replaced."""
        if self.link.beat_due(now):
            self.beats += 1
            send(self.sock, protocol.encode(Heartbeat(peer_id=self.worker_id)))
            if self.beats % self.liveness == 0 and self.link.silent_s(now) < 2 * self.heartbeat_s:
                self.ready()  # as the runtime does: a broker that dropped us learns about us again
        if not self.link.lost(now):
            return False
        self.sock.close(0)
        self.sock = self._connect()
        self.link.reconnected()
        self.log.warning("swarm.broker_lost", worker=self.worker_id)
        self.ready()
        return True

    def close(self) -> None:
        try:
            send(self.sock, protocol.encode(Disconnect(reason="swarm stopping")))
        except zmq.ZMQError:  # a socket a failed reconnect left closed: the broker drops us by liveness
            pass
        self.sock.close(0)


class Responder:
    """A link that answers its jobs at once with `answer(job) -> message | None` (None: no reply)."""

    def __init__(self, link: SwarmLink, answer: Callable[[Job], Any]):
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
