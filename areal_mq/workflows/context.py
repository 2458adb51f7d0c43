"""`ctx`, what a workflow sees: generate turns, append environment text, grade, ask the reward service.

What: `EpisodeContext` wraps one Episode trace (episode.py) and a `Backend` that turns a GenerateRequest into
a GenerateResult. In the agent role the backend is the job broker (workers/agent.py: every turn is an ordinary
GenerateRequest with `session` = the episode id, so the broker routes the turns of one episode to the rollout
worker that holds its KV); in evaluations it is an in-process engine (workflows/local.py). A workflow:

    async def episode(ctx, problem):
        turn = await ctx.generate(ctx.prompt_ids)          # first turn: the problem's formatted prompt
        if not ctx.grade(turn.text).strict:
            ctx.add_user_turn("Your answer is wrong. Try again.")   # environment tokens: mask 0, version -1
            turn = await ctx.generate()                    # continue the whole episode so far
        return 1.0 if ctx.grade(turn.text).strict else 0.0

`await ctx.score(text, truncated=...)` asks the reward service for a RewardVerdict (reward, correct, reason) under
the configured task (controller.reward_task; in evaluations and tests, local.LocalRewards scores in process);
`await ctx.reward(text)` is its reward alone. The built-in workflows grade their turns this way.
`generate(prompt)` takes token ids or chat messages; on later turns a prompt must EXTEND the episode's tokens
(the extra tokens become environment tokens), or be None (continue as is). Token ids the model wrote are never
re-tokenized from text: the trace keeps exactly the sampled ids with their logprobs and versions.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence

import numpy as np

from areal_mq.data.loaders import Problem  # the dataset's Problem (id, prompt, answer, level, meta): one definition
from areal_mq.grading import Grade, grade
from areal_mq.messages import GenerateRequest, GenerateResult, RewardJob, RewardResult, SamplingSpec
from areal_mq.workflows.episode import Episode, EpisodeTooLong

DEFAULT_REWARD_TASK = "arith"  # = controller.reward_task's default; the agent passes the configured one


class WorkflowError(ValueError):
    """A workflow misused ctx (a prompt that does not extend the episode, too many turns, ...)."""


class Backend(Protocol):
    async def generate(self, request: GenerateRequest) -> GenerateResult: ...

    async def reward(self, job: RewardJob) -> RewardResult: ...


@dataclass
class Turn:
    """One model turn: its text and exact token ids (the trace holds logprobs and versions)."""

    text: str
    output_ids: list[int]
    versions: list[int]
    finish_reason: str


@dataclass
class RewardVerdict:
    """The reward service's answer for one completion (`await ctx.score(text)`).

    reward   the task's reward (its default_reward when scoring failed: then `error` says why)
    correct  the function's `correct` detail where it gives one (arith, math do), else reward > 0
    reason   its `reason` detail ("correct", "wrong", "truncated", ... for arith), "error" when scoring failed
    details  every detail the function returned (RewardResult.details)
    """

    reward: float
    correct: bool
    reason: str = ""
    details: dict = field(default_factory=dict)
    error: str | None = None

    @classmethod
    def of(cls, result: RewardResult, i: int = 0) -> "RewardVerdict":
        reward = float(result.rewards[i])
        details = dict(result.details[i]) if i < len(result.details) else {}
        error = result.errors[i] if i < len(result.errors) else None
        correct = bool(details["correct"]) if "correct" in details else (error is None and reward > 0)
        reason = "error" if error else str(details.get("reason", ""))
        return cls(reward, correct, reason, details, error)


class ChatMarkup:
    """Environment text in the model's chat format: the end of an assistant turn and a new user turn, derived
    from the tokenizer's chat template (plain 'User:' / 'Assistant:' lines when it has none)."""

    def __init__(self, tokenizer: Any):
        self.tok = tokenizer
        self.eos = tokenizer.eos_token or ""
        try:
            sys_only = [{"role": "system", "content": "S"}]
            head = tokenizer.apply_chat_template(sys_only, tokenize=False)
            with_user = tokenizer.apply_chat_template(sys_only + [{"role": "user", "content": "\x00"}],
                                                      tokenize=False, add_generation_prompt=True)
            with_asst = tokenizer.apply_chat_template(sys_only + [{"role": "assistant", "content": "\x01"}],
                                                      tokenize=False)
            self.user_before, self.user_after = with_user[len(head):].split("\x00")
            self.turn_end = with_asst.split("\x01", 1)[1]
        except Exception:  # no chat template: plain text turns
            self.user_before, self.user_after, self.turn_end = "\n\nUser: ", "\nAssistant:", ""

    def user_turn(self, text: str, last_ids: Sequence[int]) -> list[int]:
        """Tokens closing the model's turn (unless it already closed it) and opening a user turn `text`
        followed by the assistant's generation prompt."""
        end = self.turn_end
        if end and self.eos and end.startswith(self.eos) and last_ids and \
                int(last_ids[-1]) == self.tok.eos_token_id:
            end = end[len(self.eos):]  # the model stopped at EOS: that token is already in the trace
        return self.encode(end + self.user_before + text + self.user_after)

    def encode(self, text: str) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=False)) if text else []


class EpisodeContext:
    """The `ctx` of one episode; see the module docstring. One context per episode, one event loop."""

    def __init__(self, problem: Problem, prompt_ids: Sequence[int], tokenizer: Any, backend: Backend, *,
                 sampling: SamplingSpec, episode_id: str, group_id: str = "", sample_index: int = 0,
                 min_version: int = 0, max_turns: int = 8, max_tokens: int = 4096,
                 reward_task: str = DEFAULT_REWARD_TASK,
                 args: dict | None = None):
        self.problem, self.prompt_ids, self.tokenizer, self.backend = problem, list(prompt_ids), tokenizer, backend
        self.sampling, self.episode_id, self.group_id, self.sample_index = sampling, episode_id, group_id, sample_index
        self.min_version, self.max_turns, self.max_tokens, self.reward_task = min_version, max_turns, max_tokens, reward_task
        self.args = dict(args or {})  # agent.workflow_args: the operator's settings for the workflow
        self.markup = ChatMarkup(tokenizer)
        self.episode: Episode | None = None
        self.info: dict[str, Any] = {}  # the workflow's own per-episode facts (attempts, tool calls): kept in stats
        self.finish_reason = "stop"

    # ------------------------------------------------------------ turns
    async def generate(self, prompt: Sequence[int] | Sequence[dict] | None = None,
                       sampling: SamplingSpec | None = None) -> Turn:
        """Generate one model turn after `prompt` (token ids, chat messages, or None: the episode so far)."""
        ids = self._prompt_ids(prompt)
        ep = self.episode
        if ep.turns >= self.max_turns:
            raise WorkflowError(f"episode {self.episode_id} exceeds agent.max_turns ({self.max_turns})")
        room = ep.max_tokens - ep.n_output
        if room <= 0:
            raise EpisodeTooLong(f"episode {self.episode_id} has no token budget left ({ep.max_tokens})")
        spec = (sampling or self.sampling).model_copy()
        spec.max_new_tokens = min(spec.max_new_tokens, room)
        if spec.seed is not None:
            spec.seed = (spec.seed + 7919 * ep.turns) & 0x7FFFFFFF  # a fresh stream per turn, reproducible
        result = await self.backend.generate(GenerateRequest(
            prompt_ids=np.asarray(ids, np.int32), sampling=spec, group_id=self.group_id,
            sample_index=self.sample_index, min_version=self.min_version, session=self.episode_id))
        ep.add_generated(result.output_ids, result.logprobs, result.versions)
        self.finish_reason = result.finish_reason
        return Turn(result.text, [int(t) for t in result.output_ids], [int(v) for v in result.versions],
                    result.finish_reason)

    def _prompt_ids(self, prompt: Any) -> list[int]:
        if prompt is not None and len(prompt) and isinstance(prompt[0], dict):
            text = self.tokenizer.apply_chat_template(list(prompt), tokenize=False, add_generation_prompt=True)
            prompt = self.markup.encode(text)
        if self.episode is None:
            if prompt is None:
                prompt = self.prompt_ids
            self.episode = Episode([int(t) for t in prompt], max_tokens=self.max_tokens)
            return self.episode.token_ids
        so_far = self.episode.token_ids
        if prompt is not None:
            prompt = [int(t) for t in prompt]
            if prompt[:len(so_far)] != so_far:
                raise WorkflowError("a later turn's prompt must extend the episode's tokens (the model's own "
                                    "tokens are never re-tokenized); append with ctx.add_env / add_user_turn, "
                                    "or pass None to continue")
            self.episode.add_env(prompt[len(so_far):])
        return self.episode.token_ids

    # ------------------------------------------------------------ environment
    def add_env(self, text_or_ids: str | Sequence[int]) -> None:
        """Append environment tokens (text is tokenized as is, special tokens included): mask 0, version -1."""
        self._need_episode()
        ids = self.markup.encode(text_or_ids) if isinstance(text_or_ids, str) else [int(t) for t in text_or_ids]
        self.episode.add_env(ids)

    def add_user_turn(self, text: str) -> None:
        """Close the model's turn and add a user message in the chat format, then the generation prompt."""
        self._need_episode()
        self.episode.add_env(self.markup.user_turn(text, self.episode.token_ids))

    def _need_episode(self) -> None:
        if self.episode is None:
            raise WorkflowError("generate the first turn before adding environment text")

    # ------------------------------------------------------------ rewards
    def grade(self, text: str) -> Grade:
        """areal_mq.grading's verdict of `text` against the problem's answer (strict and lenient)."""
        return grade(text, self.problem.answer)

    async def score(self, completion: str, *, truncated: bool = False, task: str | None = None) -> RewardVerdict:
        """The reward service's verdict on `completion` (reward, correct, reason) under the configured task
        (controller.reward_task; `task` selects another configured task, never code). `truncated`: the turn hit
        its token cap (pass `turn.finish_reason == "length"`), which arith scores as a penalty."""
        result = await self.backend.reward(RewardJob(
            task=task or self.reward_task, prompt_id=self.problem.id, prompt=self.problem.prompt,
            completions=[completion], reference=self.problem.answer, truncated=[bool(truncated)]))
        return RewardVerdict.of(result)

    async def reward(self, completion: str, task: str | None = None, *, truncated: bool = False) -> float:
        """The reward of `completion` from the reward service: `(await ctx.score(...)).reward`."""
        return (await self.score(completion, truncated=truncated, task=task)).reward
