"""An in-process backend for `ctx`: turns go straight to an inference engine in this process (no brokers).

What: `EngineBackend(engine)` — `await generate(GenerateRequest)` submits an EngineRequest and resolves when
the engine finishes it; a pump task steps the engine while anything is queued (one decoding step over every
running sequence of every episode, so concurrent episodes batch together). `on_step(engine)` runs after each
step: evaluations pass nothing, tests use it to publish a new policy version mid-generation.
`await reward(RewardJob)` goes to `rewards`, by default `LocalRewards()`: the run's reward tasks scored in this
process with the reward worker's own plan and functions (arith unless a RewardConfig says otherwise).
Why: held-out evaluations of a workflow (areal_mq/evaluation/episodes.py) and unit tests run the same workflow
code as the agent role, without processes. Single-threaded: one event loop owns the engine.
"""
from __future__ import annotations

import asyncio
import itertools
from typing import Any, Callable

from areal_mq.messages import GenerateRequest, GenerateResult, RewardJob, RewardResult


class LocalRewards:
    """Score RewardJobs in this process under a RewardConfig's tasks (default: arith), as a reward worker would
    (RewardExecutor.plan, the pool's run_call; a failed function gives the task's default reward and an error),
    minus its process pool, deadline, retries and cache: for evaluations and tests, which trust their own
    config. A hung function hangs the caller; an HTTP task is refused (RewardError)."""

    def __init__(self, cfg: Any = None, registry: Any = None):
        from areal_mq.rewards.config import RewardConfig
        from areal_mq.rewards.executor import RewardExecutor

        self.executor = RewardExecutor(cfg or RewardConfig(), registry)  # never started: its plans only

    async def __call__(self, job: RewardJob) -> RewardResult:
        return self.score(job)

    def score(self, job: RewardJob) -> RewardResult:
        from areal_mq.errors import RewardError
        from areal_mq.rewards._pool import run_call

        plan = self.executor.plan(job.task)
        if plan.bridge is not None:
            raise RewardError(f"reward task {job.task!r} is an HTTP task: in-process scoring does not call it")
        n = len(job.completions)
        flags = list(job.truncated) or [False] * n
        meta = {k: v for k, v in job.meta.items() if k not in plan.protected}
        calls = [(list(range(n)), list(job.completions), flags)] if plan.group else \
            [([i], job.completions[i], flags[i]) for i in range(n)]
        rewards, details, errors = [plan.default] * n, [{} for _ in range(n)], [None] * n
        for idx, completion, truncated in calls:
            try:
                out = run_call(self.executor.registry, plan.fns, plan.group, job.prompt, completion, job.reference,
                               {**meta, "prompt_id": job.prompt_id, "truncated": truncated, **plan.kwargs})
            except Exception as exc:  # like the reward worker: the default reward, and why
                for i in idx:
                    details[i], errors[i] = {"default_reward": True}, f"exception: {type(exc).__name__}: {exc}"
                continue
            for i, (reward, detail) in zip(idx, out):
                rewards[i], details[i] = reward, detail
        return RewardResult(rewards=rewards, details=details, errors=errors)


class EngineBackend:
    def __init__(self, engine: Any, on_step: Callable[[Any], None] | None = None, rewards: Any = None):
        self.engine, self.on_step = engine, on_step
        self.rewards = rewards if rewards is not None else LocalRewards()
        self.waiting: dict[str, asyncio.Future] = {}
        self._ids = itertools.count()
        self._pump: asyncio.Task | None = None

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        from areal_mq.engines.base import EngineRequest

        rid = f"turn-{next(self._ids)}"
        fut = asyncio.get_running_loop().create_future()
        self.waiting[rid] = fut
        self.engine.submit(EngineRequest(rid, [int(t) for t in request.prompt_ids], request.sampling,
                                         session=request.session))
        if self._pump is None or self._pump.done():
            self._pump = asyncio.create_task(self._run())
        out = await fut
        return GenerateResult(output_ids=out.output_ids, logprobs=out.logprobs, versions=out.versions,
                              finish_reason=out.finish_reason, text=out.text, group_id=request.group_id,
                              sample_index=request.sample_index)

    async def reward(self, job: RewardJob) -> RewardResult:
        return await self.rewards(job)

    async def _run(self) -> None:
        while self.waiting:
            if self.engine.has_work():
                for out in self.engine.step():
                    fut = self.waiting.pop(out.request_id, None)
                    if fut is not None and not fut.done():
                        fut.set_result(out)
                if self.on_step is not None:
                    self.on_step(self.engine)
            await asyncio.sleep(0)  # let episodes append environment text and submit their next turn
