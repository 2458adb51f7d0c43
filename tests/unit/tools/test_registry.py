"""The registry never lets a tool call raise: unknown tools, malformed OpenAI tool calls, schema misses, oversized
arguments, a slow tool, a tool that raises, oversized output: each an error result (or a marked cut) with the reason.
Run: pytest tests/unit/tools/test_registry.py -q   (< 2 s)
"""
from __future__ import annotations

import asyncio
import json

import pytest

from areal_mq.tools import SAMPLE_CORPUS, SearchTool, ToolLimits, ToolRegistry, ToolResult, load_corpus


class Echo:
    """A tool whose behaviour the test picks: echo, sleep, raise or shout."""

    name = "echo"
    description = "echo the text back"
    parameters = {"type": "object", "additionalProperties": False, "required": ["text"],
                  "properties": {"text": {"type": "string"}, "times": {"type": "integer", "minimum": 1},
                                 "mode": {"type": "string", "enum": ["plain", "sleep", "raise"]}}}

    async def call(self, arguments: dict) -> ToolResult:
        mode = arguments.get("mode", "plain")
        if mode == "sleep":
            await asyncio.sleep(30)
        if mode == "raise":
            raise RuntimeError("the tool's own bug")
        return ToolResult(self.name, True, arguments["text"] * arguments.get("times", 1))


def registry(**limits) -> ToolRegistry:
    return ToolRegistry([Echo(), SearchTool(load_corpus(SAMPLE_CORPUS))], ToolLimits(**limits))


def call(name, arguments, id="call_1") -> dict:
    return {"id": id, "type": "function", "function": {"name": name, "arguments": arguments}}


def test_openai_tools_lists_the_function_entries_in_order():
    reg = registry()
    tools = reg.openai_tools(["search", "echo"])
    assert [t["function"]["name"] for t in tools] == ["search", "echo"] and all(t["type"] == "function" for t in tools)
    assert tools[1]["function"] == {"name": "echo", "description": "echo the text back", "parameters": Echo.parameters}
    assert tools[0]["function"]["parameters"]["required"] == ["query"]
    assert [t["function"]["name"] for t in reg.openai_tools()] == ["echo", "search"]
    with pytest.raises(KeyError, match="unknown tool"):
        reg.openai_tools(["nope"])
    with pytest.raises(ValueError, match="already registered"):
        reg.add(Echo())


def test_dispatch_answers_a_tool_call():
    r = asyncio.run(registry().dispatch(call("echo", json.dumps({"text": "ab", "times": 2}))))
    assert (r.ok, r.output, r.reason, r.name) == (True, "abab", "", "echo") and r.seconds >= 0
    assert r.to_message("call_1") == {"role": "tool", "tool_call_id": "call_1", "content": "abab"}
    assert asyncio.run(registry().dispatch(call("echo", {"text": "x"}))).output == "x"  # an object is accepted too


@pytest.mark.parametrize("tool_call, reason, why", [
    (call("nope", "{}"), "unknown_tool", "no tool named 'nope'; available: echo, search"),
    (call("echo", '{"text": "x"'), "bad_arguments", "not valid JSON"),
    (call("echo", "[1, 2]"), "bad_arguments", "must be a JSON object, got array"),
    (call("echo", 42), "bad_arguments", "must be a JSON string"),
    (call("echo", ""), "bad_arguments", "missing required argument 'text'"),
    (call("echo", '{"text": 5}'), "bad_arguments", "argument 'text': must be string, got integer"),
    (call("echo", '{"text": "x", "times": true}'), "bad_arguments", "'times': must be integer, got boolean"),
    (call("echo", '{"text": "x", "times": 0}'), "bad_arguments", "'times': must be >= 1, got 0"),
    (call("echo", '{"text": "x", "mode": "loud"}'), "bad_arguments", "must be one of ['plain', 'sleep', 'raise']"),
    (call("echo", '{"text": "x", "cwd": "/"}'), "bad_arguments", "unknown argument 'cwd'"),
    ({"id": "c", "type": "function"}, "bad_arguments", "a tool call must be"),
    ("not a dict", "bad_arguments", "a tool call must be"),
    ({"function": {"name": None, "arguments": "{}"}}, "bad_arguments", "a tool call must be"),
    (call("echo", json.dumps({"text": "x" * 300})), "arguments_too_large", "the limit is 256"),
])
def test_malformed_tool_calls_are_error_results(tool_call, reason, why):
    r = asyncio.run(registry(max_argument_bytes=256).dispatch(tool_call))
    assert not r.ok and r.reason == reason and why in r.message, r
    assert r.content.startswith(f"error ({reason}): ")


def test_arguments_too_large_through_call_as_well():
    r = asyncio.run(registry(max_argument_bytes=256).call("echo", {"text": "x" * 300}))
    assert r.reason == "arguments_too_large"


def test_a_slow_tool_times_out_and_a_raising_tool_is_a_result():
    reg = registry(timeout_s=0.3)
    slow = asyncio.run(reg.call("echo", {"text": "x", "mode": "sleep"}))
    assert slow.reason == "timeout" and "0.3 s" in slow.message and 0.25 < slow.seconds < 5
    bug = asyncio.run(reg.call("echo", {"text": "x", "mode": "raise"}))
    assert bug.reason == "tool_error" and bug.message == "RuntimeError: the tool's own bug"


def test_output_is_cut_with_a_marker():
    r = asyncio.run(registry(max_output_chars=100).call("echo", {"text": "y", "times": 250}))
    assert r.ok and r.truncated and r.output == "y" * 100 + "\n[... 150 more characters truncated]"
    short = asyncio.run(registry(max_output_chars=100).call("echo", {"text": "y", "times": 100}))
    assert not short.truncated and short.output == "y" * 100
