"""The tool registry: name -> tool, the OpenAI `tools=` list, and bounded, never-raising calls.

What: `ToolRegistry([PythonTool(...), SearchTool(...)], limits)`; `registry.openai_tools(names)` is the
`tools=` list an OpenAI client sends; `await registry.dispatch(tool_call)` answers one `tool_calls` entry
({"id", "type": "function", "function": {"name", "arguments": "<json string>"}}); `await registry.call(name,
arguments)` is the same for a workflow that parsed a call itself (workflow.py). Every path returns a
ToolResult: an unknown tool, malformed JSON, arguments that miss the schema or are too large, a call past
limits.timeout_s and a tool that raised are all error results with the reason.
Why: a model's tool call is untrusted text; an episode must be able to read the failure and go on.
Run: python -c "import asyncio; from areal_mq.tools import default_tools; \
print(asyncio.run(default_tools().call('search', {'query': 'Harrowgate lighthouse'})).content)"
"""
from __future__ import annotations

import asyncio
import json
import time
from typing import Any, Iterable

from areal_mq.rewards.sandbox.runner import CodeSandbox
from areal_mq.tools.base import Tool, ToolLimits, ToolResult, error, truncate, validate
from areal_mq.tools.python_tool import PythonTool
from areal_mq.tools.search import SAMPLE_CORPUS, SearchTool, load_corpus


class ToolRegistry:
    """The tools one episode, agent or endpoint may call, under one set of limits. Safe to share between
    the episodes of one event loop."""

    def __init__(self, tools: Iterable[Tool] = (), limits: ToolLimits | None = None):
        self.limits = limits or ToolLimits()
        self.tools: dict[str, Tool] = {}
        for tool in tools:
            self.add(tool)

    def add(self, tool: Tool) -> None:
        if tool.name in self.tools:
            raise ValueError(f"a tool named {tool.name!r} is already registered; give the new one another name")
        self.tools[tool.name] = tool

    @property
    def names(self) -> list[str]:
        return list(self.tools)

    def openai_tools(self, names: Iterable[str] | None = None) -> list[dict]:
        """The OpenAI function-tool entries of `names` (default: every tool), in that order."""
        picked = self.names if names is None else list(names)
        unknown = [n for n in picked if n not in self.tools]
        if unknown:
            raise KeyError(f"unknown tool(s) {unknown}; registered: {', '.join(self.names) or 'none'}")
        return [{"type": "function", "function": {"name": t.name, "description": t.description,
                                                  "parameters": t.parameters}}
                for t in (self.tools[n] for n in picked)]

    async def dispatch(self, tool_call: Any) -> ToolResult:
        """Answer one OpenAI `tool_calls` entry; never raises (but lets a cancellation through)."""
        fn = tool_call.get("function") if isinstance(tool_call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            return error("", "bad_arguments", 'a tool call must be {"type": "function", "function": {"name": ..., '
                         '"arguments": "<json>"}}')
        name, raw = fn["name"], fn.get("arguments", "{}")
        if isinstance(raw, dict):  # some clients send the object itself
            return await self.call(name, raw)
        if not isinstance(raw, str):
            return error(name, "bad_arguments", "function.arguments must be a JSON string")
        if len(raw.encode()) > self.limits.max_argument_bytes:
            return self._too_large(name, len(raw.encode()))
        try:
            arguments = json.loads(raw) if raw.strip() else {}
        except (ValueError, RecursionError) as exc:
            return error(name, "bad_arguments", f"arguments are not valid JSON ({str(exc)[:200]})")
        return await self.call(name, arguments)

    async def call(self, name: str, arguments: Any) -> ToolResult:
        """Call tool `name` with already parsed `arguments` under the limits; never raises."""
        t0 = time.monotonic()
        tool = self.tools.get(name)
        if tool is None:
            return error(name, "unknown_tool", f"no tool named {str(name)[:100]!r}; available: "
                         f"{', '.join(self.names) or 'none'}")
        size = len(json.dumps(arguments, default=str).encode())
        if size > self.limits.max_argument_bytes:
            return self._too_large(name, size)
        problems = validate(tool.parameters, arguments)
        if problems:
            return error(name, "bad_arguments", "; ".join(problems))
        try:
            result = await asyncio.wait_for(tool.call(arguments), self.limits.timeout_s)
        except asyncio.TimeoutError:
            return error(name, "timeout", f"the call ran longer than {self.limits.timeout_s:g} s and was stopped",
                         seconds=time.monotonic() - t0)
        except Exception as exc:  # the tool's own bug: this call fails, the episode goes on
            return error(name, "tool_error", f"{type(exc).__name__}: {str(exc)[:300]}",
                         seconds=time.monotonic() - t0)
        result.output, cut = truncate(result.output, self.limits.max_output_chars)
        result.truncated = result.truncated or cut
        result.seconds = round(time.monotonic() - t0, 4)
        return result

    def _too_large(self, name: str, size: int) -> ToolResult:
        return error(name, "arguments_too_large", f"arguments are {size} bytes; the limit is "
                     f"{self.limits.max_argument_bytes} (tools.max_argument_bytes)")


def default_tools(corpus: str | None = None, sandbox: CodeSandbox | None = None, limits: ToolLimits | None = None,
                  max_concurrency: int = 4) -> ToolRegistry:
    """`python` (the sandbox, default limits of SandboxConfig) and `search` over `corpus` (default: the sample)."""
    return ToolRegistry([PythonTool(sandbox, max_concurrency), SearchTool(load_corpus(corpus or SAMPLE_CORPUS))],
                        limits)
