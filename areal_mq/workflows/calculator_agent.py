r"""The agent configs/tools-arith.yaml trains: arithmetic with a `calculator` function tool, written with the plain
`openai` client exactly as against any OpenAI-compatible server (nothing here knows about areal-mq's episodes).

What: `solve(client, problem)` sends the question after a system prompt and one worked example (an assistant
message calling the tool, the tool's answer, a final `\boxed{N}`), offers one function tool, `calculator`
({"expression": string}, answered by the safe evaluator of areal_mq/workflows/calc.py, never eval), answers at
most MAX_CALLS calls and returns the final reply's text. `solve_first_call` is the same agent with its first call
made with `tool_choice` naming the calculator (the OpenAI API's way to require a call; later turns are `auto`).
`solve_no_tools` is the same agent and prompt without the tool (its example computes in words): the comparison arm
of the evaluation.
Why this prompt: a 135M model does not invent a tool call it never saw; the worked example shows one
(benchmarks/quality/RESULTS.md measured the same for the `<calc>` text protocol of the tool_calc built-in).
How: agent.workflow: openai_agent, agent.workflow_args.agent: areal_mq.workflows.calculator_agent:solve
(docs/workflows.md, "Training an agent written for the OpenAI client"); standalone against any endpoint:
    solve(openai.OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="x"), problem)
"""
from __future__ import annotations

import json
from typing import Any

from areal_mq.workflows.calc import CalcError, calc

MODEL = "policy"  # the name the training endpoint serves (areal_mq/workflows/openai_agent.py)
MAX_CALLS = 3  # tool calls answered per problem; a reply that still calls after them ends the episode
MAX_TOKENS = 64  # per reply (a call is ~30 tokens; the final answer as long as the quickstart's)
STOP = ["</tool_call>"]  # a small model goes on to invent the tool's answer after its call; the call ends here
SYSTEM = "You are a careful math assistant. Use the calculator for arithmetic. End with the answer in \\boxed{}."
SYSTEM_NO_TOOLS = "You are a careful math assistant. End with the answer in \\boxed{}."

CALCULATOR = {"type": "function", "function": {
    "name": "calculator",
    "description": "Evaluate an arithmetic expression: numbers, + - * / // % ** and parentheses.",
    "parameters": {"type": "object",
                   "properties": {"expression": {"type": "string", "description": "e.g. 12 * (3 + 4)"}},
                   "required": ["expression"]}}}

EXAMPLE = [  # numbers outside every arith pool (as the quickstart's examples), so it shares nothing with a problem
    {"role": "user", "content": "What is 2 + 30?"},
    {"role": "assistant", "content": None, "tool_calls": [{"id": "call_example", "type": "function", "function": {
        "name": "calculator", "arguments": json.dumps({"expression": "2 + 30"})}}]},
    {"role": "tool", "tool_call_id": "call_example", "content": "32"},
    {"role": "assistant", "content": "2 + 30 = 32. The answer is \\boxed{32}."},
]
EXAMPLE_NO_TOOLS = [
    {"role": "user", "content": "What is 2 + 30?"},
    {"role": "assistant", "content": "2 + 30 = 32. The answer is \\boxed{32}."},
]


def calculator(arguments: str) -> str:
    """The tool: a call's JSON arguments -> the text the model reads (a bad call is answered, never raised)."""
    try:
        args = json.loads(arguments)
    except (ValueError, RecursionError):
        return 'error: the arguments are not JSON; send {"expression": "..."}'
    if not isinstance(args, dict) or not isinstance(args.get("expression"), str):
        return 'error: send {"expression": "..."} with the expression as a string'
    try:
        return calc(args["expression"])
    except CalcError as exc:
        return f"error: {exc}"


def solve(client: Any, problem: Any, max_calls: int = MAX_CALLS, first_choice: Any = "auto") -> str:
    """Answer `problem.prompt` with the calculator; the final reply's text. `first_choice`: the first call's
    tool_choice (later calls: auto)."""
    messages = [{"role": "system", "content": SYSTEM}, *EXAMPLE, {"role": "user", "content": problem.prompt}]
    for turn in range(max_calls + 1):
        reply = client.chat.completions.create(model=MODEL, messages=messages, tools=[CALCULATOR],
                                               tool_choice=first_choice if turn == 0 else "auto",
                                               max_tokens=MAX_TOKENS, stop=STOP)
        message = reply.choices[0].message
        if not message.tool_calls:
            return message.content or ""
        messages.append(message)  # the reply as served: the next call continues its tokens
        for call in message.tool_calls:
            messages.append({"role": "tool", "tool_call_id": call.id, "content": calculator(call.function.arguments)})
    return message.content or ""


def solve_first_call(client: Any, problem: Any) -> str:
    """`solve` whose first call must call the calculator (tool_choice naming it)."""
    return solve(client, problem, first_choice={"type": "function", "function": {"name": "calculator"}})


def solve_no_tools(client: Any, problem: Any) -> str:
    """The same agent without the tool: one reply."""
    messages = [{"role": "system", "content": SYSTEM_NO_TOOLS}, *EXAMPLE_NO_TOOLS,
                {"role": "user", "content": problem.prompt}]
    reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=MAX_TOKENS)
    return reply.choices[0].message.content or ""
