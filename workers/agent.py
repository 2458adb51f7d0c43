"""`areal-mq worker agent --workflow M:F`: the agent role runs multi-turn episodes of a workflow.

Dataflow:

    controller --EpisodeJob--> job broker (service "agent") --> AgentRole.on_job (role thread)
                                                                   | run_coroutine_threadsafe
                                                                   v
      asyncio thread: run_episode(workflow, ctx) -- ctx.generate --> AgentBackend --GenerateRequest(session=
                      episode id)--> job broker --> rollout workers --GenerateResult--> (futures resolved by
                      the pump task: AsyncJobFutures, areal_mq/actor/job_futures.py) ... workflow returns
                      reward --> Episode trace -> SeqSample
                                                                   |
    controller <--EpisodeResult (or Error job_failed)-- runtime.reply (thread-safe) <--+

Invariants: every EpisodeJob taken is answered once (EpisodeResult, or Error when the workflow raised, timed out
or returned no finite reward: `agent.episode_failed` names the episode and why; the controller retries it, then
fails the group), unless this process dies: then the broker requeues the job to another agent (heartbeats).
The workflow is only code the operator named (`--workflow` / agent.workflow), loaded before READY: nothing on
the wire selects code. Episodes run concurrently (up to agent.max_episodes = the capacity announced in READY);
a turn is an ordinary GenerateRequest submitted through the broker with the agent role's "submit" right.
A workflow that blocks the event loop (time.sleep, a CPU loop) stalls every episode of this agent: workflows
must await, not block.
Run: areal-mq worker agent --config configs/multiturn.yaml [--workflow my_pkg.flows:episode]
"""
from __future__ import annotations

import asyncio
import threading
from typing import Any

from areal_mq.errors import JobFailed
from areal_mq.messages import EpisodeJob, EpisodeResult, Error
from areal_mq.actor.job_futures import AsyncJobFutures
from areal_mq.actor.roles import Role, RoleLoop


class AgentBackend:
    """ctx's backend in the agent: turns and reward calls as jobs through the job broker (AsyncJobFutures on the
    asyncio thread, which alone touches its JobClient, made there by `make_client`). A broker Error raises
    JobFailed in the workflow; a cancelled call (the episode's timeout) forgets its job."""

    def __init__(self, make_client: Any, poll_s: float = 0.005):
        self.jobs = AsyncJobFutures(make_client, poll_s)

    async def start(self) -> None:
        await self.jobs.start()

    async def call(self, msg: Any, service: str) -> Any:
        answer = await self.jobs.call(msg, service)
        if isinstance(answer, Error):
            raise JobFailed(f"{service} job failed: [{answer.code}] {answer.message}")
        return answer

    async def generate(self, request: Any) -> Any:
        return await self.call(request, "generate")

    async def reward(self, job: Any) -> Any:
        return await self.call(job, "reward")

    async def close(self) -> None:
        await self.jobs.close()


class AgentRole(Role):
    """Takes EpisodeJobs, runs them on the asyncio thread, answers from there (runtime.reply is thread-safe)."""

    name = "agent"
    drain_timeout_s = 30.0

    def __init__(self, rt: Any, cfg: Any, workflow: Any, tokenizer: Any, backend: AgentBackend):
        super().__init__(rt)
        self.cfg, self.acfg, self.workflow, self.tokenizer, self.backend = cfg, cfg.agent, workflow, tokenizer, backend
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="agent-episodes", daemon=True)
        self.counts = {"done": 0, "failed": 0, "turns": 0}
        self.rewards: list[float] = []

    def start(self) -> None:
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self.backend.start(), self.loop).result(30)

    def on_job(self, job: Any) -> None:
        if not isinstance(job.msg, EpisodeJob):
            self.rt.fail(job, "bad_request", f"agent workers take episode_job, got {job.msg.kind.value}")
            return
        fut = asyncio.run_coroutine_threadsafe(self._episode(job.msg), self.loop)
        fut.add_done_callback(lambda f: self._done(job, f))

    async def _episode(self, msg: EpisodeJob) -> Any:
        from areal_mq.data.loaders import Problem
        from areal_mq.workflows.context import EpisodeContext
        from areal_mq.workflows.runner import run_episode

        a = self.acfg
        ctx = EpisodeContext(Problem(msg.problem_id, msg.prompt, msg.answer, msg.level), msg.prompt_ids,
                             self.tokenizer, self.backend, sampling=msg.sampling, episode_id=msg.episode_id,
                             group_id=msg.group_id, sample_index=msg.sample_index, min_version=msg.min_version,
                             max_turns=a.max_turns, max_tokens=a.max_episode_tokens,
                             reward_task=self.cfg.controller.reward_task, args=a.workflow_args)
        return await run_episode(self.workflow, ctx, ctx.problem, a.episode_timeout_s)

    def _done(self, job: Any, fut: Any) -> None:
        msg = job.msg
        exc = fut.exception()
        outcome = None if exc is not None else fut.result()
        error = f"{type(exc).__name__}: {exc}" if exc is not None else outcome.error
        if error is not None:
            self.counts["failed"] += 1
            self.log.warning("agent.episode_failed", episode=msg.episode_id, group=msg.group_id, error=error[:500])
            self.rt.fail(job, "job_failed", f"episode {msg.episode_id} failed: {error[:500]}")
            return
        self.counts["done"] += 1
        self.counts["turns"] += outcome.turns
        self.rewards.append(outcome.seq.reward)
        self.rt.reply(job, EpisodeResult(seq=outcome.seq, turns=outcome.turns, worker_id=self.rt.worker_id))
        self.log.info("agent.episode_done", episode=msg.episode_id, turns=outcome.turns, reward=outcome.seq.reward,
                      tokens=len(outcome.seq.output_ids), seconds=round(outcome.seconds, 2), **outcome.seq.info)

    def busy(self) -> bool:
        return self.rt.in_flight > 0

    def stats(self) -> dict:
        recent = self.rewards[-200:]
        return {**self.counts, "in_flight": self.rt.in_flight,
                "reward_mean": round(sum(recent) / len(recent), 4) if recent else None}

    def close(self) -> None:
        try:
            asyncio.run_coroutine_threadsafe(self.backend.close(), self.loop).result(5)
        except Exception:  # the loop is going away anyway
            pass
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


def main(cfg: Any, worker_id: str | None = None) -> int:
    from areal_mq.client import JobClient
    from areal_mq.engines.models import load_tokenizer, resolve_model
    from areal_mq.errors import ConfigError
    from areal_mq.actor.runtime import WorkerRuntime
    from areal_mq.workflows.runner import load_workflow

    if not cfg.agent.workflow:
        raise ConfigError("the agent role needs a workflow: --workflow NAME|module:function or agent.workflow")
    workflow = load_workflow(cfg.agent.workflow)  # before READY: a bad spec never takes a job
    tokenizer = load_tokenizer(resolve_model(cfg.model.name, cfg.model.cache_dir))
    rt = WorkerRuntime(cfg, role="agent", service="agent", capacity=cfg.agent.max_episodes, worker_id=worker_id,
                       topics=("control",))
    b = cfg.brokers
    backend = AgentBackend(lambda: JobClient(b.job_addr, keys=rt.keys, heartbeat_s=b.heartbeat_s,
                                             liveness=b.liveness, retry_s=cfg.job_retry_s("generate"), log=rt.log))
    role = AgentRole(rt, cfg, workflow, tokenizer, backend)
    try:
        role.start()
        rt.start()
        rt.ready()
        rt.log.info("agent.started", workflow=cfg.agent.workflow, capacity=cfg.agent.max_episodes)
        RoleLoop(rt, role).run()
        return 0
    finally:
        rt.close()
        role.close()
