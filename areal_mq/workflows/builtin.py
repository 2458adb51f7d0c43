r"""The built-in workflows: `single`, `multi_turn_retry`, `tool_calc` (agent.workflow names one of BUILTINS below,
or any `module:function` the operator names; `areal-mq worker agent --help` lists them).

Every built-in grades a turn with the reward service, `await ctx.score(text, truncated=...)`, under the run's
task (controller.reward_task, default arith: 1 for exactly one final correct \boxed{N}, 0 wrong, -0.5 for
truncation, repeated or malformed boxes; areal_mq.rewards.arith_reward), so a configured task applies to them too.
- `single`: one turn, rewarded like the single-turn reward job; the same training signal as the classic path,
  through the agent role.
- `multi_turn_retry` (AReaL's multi-turn math example): up to `attempts` (agent.workflow_args, default 2)
  turns; an incorrect answer (the verdict's `correct`) gets the feedback turn "Your answer is wrong. Try again."
  and the model answers again in the same episode. Reward: `discount ** k` for a correct answer at attempt k
  (1.0 first try, 0.5 second), else the last attempt's reward when it is a penalty (truncation, repeated
  boxes), else 0.
- `tool_calc`: the model may write `<calc>EXPR</calc>`; the workflow evaluates EXPR with the safe calculator
  (workflows/calc.py, never eval), appends `<result>VALUE</result>` as environment tokens and lets the model
  continue its answer; at most `max_calls` (default 2) calls. Reward: the task's reward of the final text.
  A worked example in the prompt shows the tool (a 135M model does not invent a tag it never saw).
- `openai_agent`: runs an agent written with the plain `openai` client, `def solve(client, problem) -> str` (or
  `async def` taking an AsyncOpenAI), named by `agent` (agent.workflow_args, 'module:function', e.g.
  areal_mq.workflows.calculator_agent:solve); its chat completions go through an in-process OpenAI endpoint
  to the run's rollout workers and are recorded token by token as the episode (areal_mq/workflows/openai_agent.py).
  Reward: the task's reward of the text the agent returns.
Each sets ctx.info (attempts, correct_at, tool_calls) which the controller logs and evaluations count.
"""
from __future__ import annotations

from typing import Any

from areal_mq.workflows.calc import CalcError, calc

FEEDBACK = "Your answer is wrong. Try again."
CALC_OPEN, CALC_CLOSE = "<calc>", "</calc>"
TOOL_SYSTEM = ("You can use a calculator: write <calc>EXPRESSION</calc> and its result appears as "
               "<result>VALUE</result>. End with the answer in \\boxed{}.")
TOOL_EXAMPLE = [{"role": "user", "content": "What is 2 + 30?"},
                {"role": "assistant", "content": "<calc>2 + 30</calc><result>32</result> "
                                                 "The answer is \\boxed{32}."}]


async def single(ctx: Any, problem: Any) -> float:
    turn = await ctx.generate(ctx.prompt_ids)
    verdict = await ctx.score(turn.text, truncated=turn.finish_reason == "length")
    ctx.info.update(attempts=1, correct_at=1 if verdict.correct else 0)
    return verdict.reward


async def multi_turn_retry(ctx: Any, problem: Any) -> float:
    attempts = int(ctx.args.get("attempts", 2))
    discount = float(ctx.args.get("discount", 0.5))
    turn = await ctx.generate(ctx.prompt_ids)
    for k in range(attempts):
        verdict = await ctx.score(turn.text, truncated=turn.finish_reason == "length")
        ctx.info.update(attempts=k + 1, correct_at=k + 1 if verdict.correct else 0)
        if verdict.correct:
            return discount ** k
        if k + 1 < attempts:
            ctx.add_user_turn(str(ctx.args.get("feedback", FEEDBACK)))
            turn = await ctx.generate()
    return min(0.0, verdict.reward)


async def tool_calc(ctx: Any, problem: Any) -> float:
    max_calls = int(ctx.args.get("max_calls", 2))
    messages = [{"role": "system", "content": TOOL_SYSTEM}, *TOOL_EXAMPLE,
                {"role": "user", "content": problem.prompt}]
    sampling = ctx.sampling.model_copy(update={"stop_strings": [CALC_CLOSE]})
    turn = await ctx.generate(messages, sampling)
    text, calls, errors = turn.text, 0, 0
    while calls < max_calls and (expr := pending_call(text)) is not None:
        calls += 1
        try:
            value = calc(expr)
        except CalcError as exc:
            value, errors = f"error: {exc}", errors + 1
        closing = "" if ctx.tokenizer.decode(turn.output_ids).rstrip().endswith(CALC_CLOSE) else CALC_CLOSE
        ctx.add_env(f"{closing}<result>{value}</result>")
        turn = await ctx.generate(None, sampling if calls < max_calls else ctx.sampling)
        text = turn.text
    ctx.info.update(tool_calls=calls, tool_errors=errors)
    verdict = await ctx.score(text, truncated=turn.finish_reason == "length")
    ctx.info.update(correct_at=1 if verdict.correct else 0)
    return verdict.reward


def pending_call(text: str) -> str | None:
    """The expression of a `<calc>` the text opened last and did not answer (None: no call pending)."""
    start = text.rfind(CALC_OPEN)
    if start < 0 or "<result>" in text[start:] or "\\boxed" in text[start:]:
        return None
    return text[start + len(CALC_OPEN):].split(CALC_CLOSE, 1)[0]


async def openai_agent(ctx: Any, problem: Any) -> float:
    from areal_mq.workflows.openai_agent import openai_agent as run  # the endpoint and openai only when used

    return await run(ctx, problem)


BUILTINS = {"single": single, "multi_turn_retry": multi_turn_retry, "tool_calc": tool_calc,
            "openai_agent": openai_agent}
