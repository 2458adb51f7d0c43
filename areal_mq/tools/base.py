"""What every tool shares: the result type, the limits, argument validation against the tool's JSON schema.

What: a tool is an object with `name`, `description`, `parameters` (a JSON schema of its arguments, the OpenAI
function-tool format) and `async call(arguments) -> ToolResult`. `ToolResult` is what an episode or an endpoint
agent gets back: text output, ok or not, the reason when not, the seconds it took. `validate(schema, args)`
checks the arguments before a tool sees them (required fields, types, unknown fields, enum, bounds).
Why: a model writes the arguments, so they are untrusted; a tool's failure must be a result the model can read
and the episode can go on after, never an exception that ends the episode (registry.py enforces that).

    reason: "" (ok) | unknown_tool | bad_arguments | arguments_too_large | timeout | tool_error |
            sandbox_refused | no_corpus | (the python tool) one of the code sandbox's reasons
            (areal_mq/rewards/sandbox/runner.py: error, syntax_error, timeout, cpu_limit, memory_limit,
            read_blocked, write_blocked, network_blocked, process_limit, syscall_blocked, output_limit, ...)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from pydantic import BaseModel, ConfigDict, Field

TRUNCATED = "\n[... {n} more characters truncated]"


class ToolLimits(BaseModel):
    """Bounds the registry puts on every call, whatever the tool."""

    model_config = ConfigDict(extra="forbid")
    max_argument_bytes: int = Field(16_384, ge=64, description="A call whose JSON arguments are longer is refused "
                                    "(arguments_too_large) before the tool runs.")
    max_output_chars: int = Field(4_000, ge=64, description="Output beyond this is cut, with a marker saying how "
                                  "much was cut (ToolResult.truncated).")
    timeout_s: float = Field(30.0, gt=0, description="Wall-clock limit of one call (reason timeout). A tool with "
                             "a tighter limit of its own (the python tool's sandbox timeout_s) reports that one.")


@dataclass
class ToolResult:
    """One call's outcome. `output` is what the tool printed or found (bounded); `message` says why it failed."""

    name: str
    ok: bool
    output: str = ""
    reason: str = ""  # "" when ok, else one of the module docstring's reasons
    message: str = ""  # a sentence for the model and the log when not ok
    seconds: float = 0.0
    truncated: bool = False
    data: Any = None  # structured output where a tool has one (the search tool's hits), for code, not the model

    @property
    def content(self) -> str:
        """The text a model reads: the output, preceded by `error (reason): message` when the call failed."""
        if self.ok:
            return self.output
        head = f"error ({self.reason}): {self.message}"
        return f"{head}\n{self.output}" if self.output else head

    def to_message(self, tool_call_id: str) -> dict:
        """The OpenAI chat message answering a `tool_calls` entry."""
        return {"role": "tool", "tool_call_id": tool_call_id, "content": self.content}


def error(name: str, reason: str, message: str, output: str = "", seconds: float = 0.0) -> ToolResult:
    return ToolResult(name, False, output, reason, message, seconds)


class Tool(Protocol):
    name: str
    description: str
    parameters: dict  # JSON schema: {"type": "object", "properties": {...}, "required": [...]}

    async def call(self, arguments: dict) -> ToolResult: ...


def truncate(text: str, limit: int) -> tuple[str, bool]:
    """`text` cut to `limit` characters plus a marker naming how many were cut."""
    if len(text) <= limit:
        return text, False
    return text[:limit] + TRUNCATED.format(n=len(text) - limit), True


_TYPES = {"string": (str,), "integer": (int,), "number": (int, float), "boolean": (bool,), "object": (dict,),
          "array": (list,), "null": (type(None),)}


def validate(schema: dict, arguments: Any) -> list[str]:
    """What is wrong with `arguments` for an object `schema` (empty: nothing). Checks required fields, unknown
    fields (additionalProperties false), each property's type, enum, minimum/maximum and maxLength; a bool is
    never an integer or a number."""
    if not isinstance(arguments, dict):
        return [f"arguments must be a JSON object, got {_type_name(arguments)}"]
    props = schema.get("properties", {})
    out = [f"missing required argument {k!r}" for k in schema.get("required", []) if k not in arguments]
    if schema.get("additionalProperties", True) is False:
        out += [f"unknown argument {k!r} (expected: {', '.join(props) or 'none'})"
                for k in arguments if k not in props]
    for key, value in arguments.items():
        if key in props:
            out += [f"argument {key!r}: {e}" for e in _check(props[key], value)]
    return out


def _check(spec: dict, value: Any) -> list[str]:
    kind = spec.get("type")
    if kind in _TYPES and (not isinstance(value, _TYPES[kind]) or
                           (isinstance(value, bool) and kind in ("integer", "number"))):
        return [f"must be {kind}, got {_type_name(value)}"]
    if "enum" in spec and value not in spec["enum"]:
        return [f"must be one of {spec['enum']}, got {value!r}"]
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if "minimum" in spec and value < spec["minimum"]:
            return [f"must be >= {spec['minimum']}, got {value}"]
        if "maximum" in spec and value > spec["maximum"]:
            return [f"must be <= {spec['maximum']}, got {value}"]
    if isinstance(value, str) and "maxLength" in spec and len(value) > spec["maxLength"]:
        return [f"longer than {spec['maxLength']} characters ({len(value)})"]
    if isinstance(value, str) and spec.get("minLength") and len(value) < spec["minLength"]:
        return [f"shorter than {spec['minLength']} characters"]
    return []


def _type_name(value: Any) -> str:
    for name, types in _TYPES.items():
        if isinstance(value, types) and not (isinstance(value, bool) and name in ("integer", "number")):
            return name
    return type(value).__name__
