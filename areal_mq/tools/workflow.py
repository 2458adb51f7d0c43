r"""Tools inside a workflow: the model writes `<tool_call>{json}</tool_call>`, the registry answers, the model goes on.

What: the Hermes / Qwen2.5 tool-call format, which Qwen's chat templates teach their models:

    <tool_call>
    {"name": "search", "arguments": {"query": "Veltran lighthouse"}}
    </tool_call>

`pending_tool_call(text)` is the body of the last call the text opened and nothing answered yet (None: none);
`await answer_call(registry, body)` parses it and calls the tool, an error result for malformed JSON or a bad
shape (never an exception); `await tool_episode(ctx, problem, registry)` is a whole workflow: a system prompt
listing the tools (from registry.openai_tools, so the list is never kept twice), turns that stop at
`</tool_call>`, each call's result appended as environment tokens `<tool_response>...</tool_response>` (mask 0,
never trained), at most `max_calls` calls, then the final text graded by the reward service (ctx.score).
Why in the tools room: a workflow author needs the same parsing, bounds and result text as an endpoint agent;
only the transport differs (token text here, OpenAI `tool_calls` there: registry.dispatch).
How (a workflow module the operator names with agent.workflow: my_pkg.search_flow:episode):

    TOOLS = default_tools(corpus="docs_for_rl/")        # built once per process, shared by its episodes
    async def episode(ctx, problem):
        return await tool_episode(ctx, problem, TOOLS, names=["search"], max_calls=3)
"""
from __future__ import annotations

import json
from typing import Any, Iterable

from areal_mq.tools.base import ToolResult, error
from areal_mq.tools.registry import ToolRegistry

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
RESPONSE_OPEN, RESPONSE_CLOSE = "<tool_response>", "</tool_response>"
SYSTEM = ("You may call tools. To call one, write\n<tool_call>\n{{\"name\": NAME, \"arguments\": {{...}}}}\n"
          "</tool_call>\nand its result appears in <tool_response></tool_response>. Tools:\n{tools}\n"
          "When you know the answer, give it in \\boxed{{}}.")


def pending_tool_call(text: str) -> str | None:
    """The body of the `<tool_call>` the text opened last and no `<tool_response>` answered (None: none)."""
    start = text.rfind(CALL_OPEN)
    if start < 0 or RESPONSE_OPEN in text[start:]:
        return None
    return text[start + len(CALL_OPEN):].split(CALL_CLOSE, 1)[0].strip()


async def answer_call(registry: ToolRegistry, body: str) -> ToolResult:
    """Call the tool a `<tool_call>` body names: {"name": ..., "arguments": {...} or "<json>"}; never raises."""
    if len(body.encode()) > 2 * registry.limits.max_argument_bytes:
        return error("", "arguments_too_large", f"the tool call is {len(body.encode())} bytes; arguments may be "
                     f"{registry.limits.max_argument_bytes}")
    try:
        call = json.loads(body)
    except (ValueError, RecursionError) as exc:
        return error("", "bad_arguments", f'a tool call must be JSON {{"name": ..., "arguments": {{...}}}} '
                     f"({str(exc)[:200]})")
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return error("", "bad_arguments", 'a tool call must be a JSON object with a string "name"')
    arguments = call.get("arguments", {})
    if isinstance(arguments, str):  # the OpenAI habit of a JSON string: dispatch parses it
        return await registry.dispatch({"type": "function", "function": {"name": call["name"],
                                                                         "arguments": arguments}})
    return await registry.call(call["name"], arguments)


def tools_prompt(registry: ToolRegistry, names: Iterable[str] | None = None) -> str:
    """The system prompt naming each tool with its description and argument schema."""
    lines = [json.dumps(t["function"]) for t in registry.openai_tools(names)]
    return SYSTEM.format(tools="\n".join(lines))


async def tool_episode(ctx: Any, problem: Any, registry: ToolRegistry, *, names: Iterable[str] | None = None,
                       max_calls: int = 3) -> float:
    """A whole tool-using episode (module docstring); sets ctx.info tool_calls, tool_errors, tool_seconds,
    correct_at."""
    messages = [{"role": "system", "content": tools_prompt(registry, names)},
                {"role": "user", "content": problem.prompt}]
    allowed = set(registry.names if names is None else names)
    sampling = ctx.sampling.model_copy(update={"stop_strings": [CALL_CLOSE]})
    turn = await ctx.generate(messages, sampling)
    calls, errors, seconds = 0, 0, 0.0
    while calls < max_calls and (body := pending_tool_call(turn.text)) is not None:
        calls += 1
        result = await _answer_allowed(registry, body, allowed)
        errors += not result.ok
        seconds += result.seconds
        closing = "" if ctx.tokenizer.decode(turn.output_ids).rstrip().endswith(CALL_CLOSE) else CALL_CLOSE
        ctx.add_env(f"{closing}\n{RESPONSE_OPEN}\n{result.content}\n{RESPONSE_CLOSE}\n")
        turn = await ctx.generate(None, sampling if calls < max_calls else ctx.sampling)
    ctx.info.update(tool_calls=calls, tool_errors=errors, tool_seconds=round(seconds, 3))
    verdict = await ctx.score(turn.text, truncated=turn.finish_reason == "length")
    ctx.info.update(correct_at=1 if verdict.correct else 0)
    return verdict.reward


async def _answer_allowed(registry: ToolRegistry, body: str, allowed: set[str]) -> ToolResult:
    try:
        name = json.loads(body).get("name")
    except (ValueError, RecursionError, AttributeError):
        name = None
    if isinstance(name, str) and name not in allowed:  # registered, but not offered to this episode
        return error(name, "unknown_tool", f"no tool named {name[:100]!r}; available: {', '.join(sorted(allowed))}")
    return await answer_call(registry, body)
