"""An in-process backend for `ctx`: turns go straight to an inference engine in this process (no brokers).

What: `EngineBackend(engine)` — `await generate(GenerateRequest)` submits an EngineRequest and resolves when
the engine finishes it; a pump task steps the engine while anything is queued (one decoding step over every
running sequence of every episode, so concurrent episodes batch together). `on_step(engine)` runs after each
step: evaluations pass nothing, tests use it to publish a new policy version mid-generation.
Why: held-out evaluations of a workflow (areal_mq/evaluation/episodes.py) and unit tests run the same workflow
code as the agent role, without processes. Single-threaded: one event loop owns the engine.
"""
from __future__ import annotations

import asyncio
import itertools
from typing import Any, Callable

from areal_mq.messages import GenerateRequest, GenerateResult


class EngineBackend:
    def __init__(self, engine: Any, on_step: Callable[[Any], None] | None = None):
        self.engine, self.on_step = engine, on_step
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

    async def reward(self, job: Any) -> Any:
        raise NotImplementedError("the in-process backend has no reward service; return the reward directly")

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
