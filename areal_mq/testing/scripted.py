"""ScriptedModel: a workflow backend that answers each turn with the next text of a script, for workflow tests.

What: `ScriptedModel(tokenizer, texts)` is what an EpisodeContext's backend must be (`await generate(request)`,
`await reward(job)`): turn k gets `texts[k]`, tokenized with the episode's tokenizer and stamped with policy
version `version` and logprob `logprob` per token; every GenerateRequest is kept in `requests` (prompt ids,
sampling, session) and every RewardJob in `reward_jobs`. `reward` (ctx.score / ctx.reward) answers with
`rewards(job)`: a float or a dict {"reward": r, "correct": ..., "reason": ...} (one per completion, details as a
reward function's), a whole RewardResult, or an awaitable of one; `rewards=LocalRewards()`
(areal_mq.workflows.local) scores with the real task functions (arith), as the built-ins' tests do.
Why: a workflow's logic (when it retries, what it appends, what reward it returns) is tested without a model,
an engine or brokers, in milliseconds, the way tests/unit/workflows/ tests the built-ins.
How (docs/workflows.md, "Testing your workflow"):

    model = ScriptedModel(tokenizer, ["It is 6.", "Sorry: it is 5."])
    ctx = EpisodeContext(problem, prompt_ids, tokenizer, model, sampling=SamplingSpec(), episode_id="ep-1")
    outcome = asyncio.run(run_episode(my_workflow, ctx, problem, timeout_s=10))
"""
from __future__ import annotations

import inspect
from typing import Any, Callable, Iterable

from areal_mq.messages import GenerateRequest, GenerateResult, RewardJob, RewardResult


class ScriptedModel:
    def __init__(self, tokenizer: Any, texts: Iterable[str], version: int = 2, logprob: float = -0.1,
                 rewards: Callable[[RewardJob], Any] | None = None):
        self.tokenizer, self.texts, self.version, self.logprob = tokenizer, list(texts), version, logprob
        self.rewards = rewards
        self.requests: list[GenerateRequest] = []
        self.reward_jobs: list[RewardJob] = []

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        turn = len(self.requests)
        self.requests.append(request)
        if turn >= len(self.texts):
            raise AssertionError(f"ScriptedModel: the workflow asked for turn {turn + 1}, but the script has "
                                 f"{len(self.texts)} text(s); add the answer it should get")
        ids = self.tokenizer.encode(self.texts[turn], add_special_tokens=False)
        return GenerateResult(output_ids=ids, logprobs=[self.logprob] * len(ids), versions=[self.version] * len(ids),
                              finish_reason="stop", text=self.tokenizer.decode(ids), group_id=request.group_id,
                              sample_index=request.sample_index)

    async def reward(self, job: RewardJob) -> RewardResult:
        self.reward_jobs.append(job)
        if self.rewards is None:
            raise AssertionError("ScriptedModel: the workflow called ctx.reward, but no `rewards=` was given")
        out = self.rewards(job)
        if inspect.isawaitable(out):
            out = await out
        if isinstance(out, RewardResult):
            return out
        from areal_mq.rewards.registry import normalize_output

        reward, details = normalize_output(out)
        n = len(job.completions)
        return RewardResult(rewards=[reward] * n, details=[dict(details) for _ in range(n)], errors=[None] * n)
