"""OpenAI chat-completions wire format: validate a request, map it to SamplingSpecs, build the response.

What: `parse_chat(body, limits, model)` checks a decoded JSON body field by field and returns a ChatCall
(messages, SamplingSpecs for the n choices, logprobs flag, episode id); anything wrong raises ApiError
carrying the HTTP status and OpenAI-style error JSON `{"error": {"message", "type", "param", "code"}}`.
`chat_response(...)` renders GenerateResults as a `chat.completion` object.
Why apart from the server: pure functions, unit-tested without sockets, a broker or a tokenizer.
Supported: messages (string content or text parts; assistant `tool_calls`, tool `tool_call_id`), model,
temperature, top_p, max_tokens / max_completion_tokens, stop, seed, n, logprobs, top_logprobs = 0, user, tools
(function tools, bounded in number and size) and tool_choice (auto, none, required, a named function),
parallel_tool_calls (accepted; a reply may hold several calls either way), stream (n 1, no logprobs) with
stream_options {include_usage}: `chunk(...)` renders one `chat.completion.chunk`. Not supported (400): stream with
n > 1 or logprobs, top_logprobs > 0 (the engines record only the sampled token's logprob), functions /
function_call (the old form), response_format.
"""
from __future__ import annotations

import json
import re
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable

from areal_mq.messages import MAX_SESSION_LEN, GenerateResult, SamplingSpec

ROLES = {"system", "user", "assistant", "tool", "developer"}
EPISODE_ID = re.compile(r"^[A-Za-z0-9_.:@-]{1,%d}$" % MAX_SESSION_LEN)
UNSUPPORTED = ("functions", "function_call", "response_format", "logit_bias", "audio", "modalities", "prediction")
TOOL_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
TOOL_CHOICES = ("auto", "none", "required")


@dataclass(frozen=True)
class ApiLimits:
    max_messages: int = 256
    max_content_chars: int = 200_000  # all messages together
    max_tokens: int = 1024  # largest max_tokens a request may ask for
    default_max_tokens: int = 256  # when a request names none
    max_n: int = 8
    max_stop: int = 4
    max_stop_chars: int = 256
    max_tools: int = 64
    max_tools_chars: int = 65_536  # the tools array as JSON
    max_tool_calls: int = 64  # per assistant message in the history


class ApiError(Exception):
    """An answer to the client: HTTP `status` and the OpenAI error object."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type_: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type_

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


@dataclass
class ChatCall:
    messages: list[dict]
    samplings: list[SamplingSpec]  # one per choice (n)
    logprobs: bool
    episode_id: str  # "" = none
    tools: list[dict] = field(default_factory=list)  # OpenAI function tools, as sent
    tool_choice: str | dict = "auto"  # "auto" | "none" | "required" | {"type": "function", "function": {"name"}}
    stream: bool = False  # answer as server-sent chat.completion.chunk events
    include_usage: bool = False  # stream_options.include_usage: a last chunk with usage and no choices


def bad(message: str, param: str | None = None, code: str | None = "invalid_value") -> ApiError:
    return ApiError(400, message, param, code)


def _number(body: dict, name: str, default: float, low: float, high: float, low_open: bool = False) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise bad(f"{name} must be a number, got {type(value).__name__}", name, "invalid_type")
    if not (low < value if low_open else low <= value) or value > high:
        raise bad(f"{name} must be in {'(' if low_open else '['}{low}, {high}], got {value}", name)
    return float(value)


def _int(body: dict, name: str, default: int | None, low: int, high: int) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad(f"{name} must be an integer, got {type(value).__name__}", name, "invalid_type")
    if not low <= value <= high:
        raise bad(f"{name} must be between {low} and {high}, got {value}", name)
    return value


def _content(msg: dict, i: int) -> str:
    content = msg.get("content")
    if content is None and msg.get("role") == "assistant":
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
        parts = []
        for part in content:
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise bad(f"messages[{i}].content: only text parts are supported", f"messages[{i}].content")
            parts.append(part["text"])
        return "".join(parts)
    raise bad(f"messages[{i}].content must be a string or a list of text parts", f"messages[{i}].content",
              "invalid_type")


def parse_messages(value: Any, limits: ApiLimits) -> list[dict]:
    if not isinstance(value, list) or not value:
        raise bad("messages must be a non-empty array of {role, content} objects", "messages",
                  "invalid_type" if value is not None else "missing_required_parameter")
    if len(value) > limits.max_messages:
        raise bad(f"at most {limits.max_messages} messages, got {len(value)}", "messages")
    out, chars = [], 0
    for i, msg in enumerate(value):
        # a role of an unhashable type ([..], {..}) must be refused, not raise TypeError out of `in` (fuzzing)
        if not isinstance(msg, dict) or not isinstance(msg.get("role"), str) or msg["role"] not in ROLES:
            raise bad(f"messages[{i}] must be an object with role one of {sorted(ROLES)}", f"messages[{i}].role")
        text = _content(msg, i)
        chars += len(text)
        role = "system" if msg["role"] == "developer" else msg["role"]
        item = {"role": role, "content": text}
        if role == "assistant" and msg.get("tool_calls"):
            item["tool_calls"] = _tool_calls(msg["tool_calls"], i, limits)
            chars += sum(len(c["function"]["arguments"]) for c in item["tool_calls"])
        if role == "tool":
            call_id = msg.get("tool_call_id")
            if not isinstance(call_id, str) or not 0 < len(call_id) <= 256:
                raise bad(f"messages[{i}]: a tool message needs tool_call_id (a string of 1-256 characters)",
                          f"messages[{i}].tool_call_id")
            item["tool_call_id"] = call_id
        out.append(item)
    if chars > limits.max_content_chars:
        raise bad(f"messages hold {chars} characters, more than {limits.max_content_chars}", "messages")
    return out


def _tool_calls(value: Any, i: int, limits: ApiLimits) -> list[dict]:
    """An assistant message's tool_calls as {"id", "type": "function", "function": {"name", "arguments": str}}."""
    param = f"messages[{i}].tool_calls"
    if not isinstance(value, list) or len(value) > limits.max_tool_calls:
        raise bad(f"{param} must be an array of at most {limits.max_tool_calls} calls", param, "invalid_type")
    out = []
    for j, call in enumerate(value):
        fn = call.get("function") if isinstance(call, dict) else None
        if not (isinstance(fn, dict) and isinstance(fn.get("name"), str) and isinstance(fn.get("arguments"), str)
                and isinstance(call.get("id"), str) and call.get("type", "function") == "function"):
            raise bad(f'{param}[{j}] must be {{"id": str, "type": "function", "function": {{"name": str, '
                      '"arguments": str}}}}', f"{param}[{j}]", "invalid_type")
        out.append({"id": call["id"], "type": "function",
                    "function": {"name": fn["name"], "arguments": fn["arguments"]}})
    return out


def _tools(body: dict, limits: ApiLimits) -> tuple[list[dict], str | dict]:
    """`tools` (function tools only) and `tool_choice`, bounded; a named choice must name a listed tool."""
    tools, choice = body.get("tools") or [], body.get("tool_choice")
    if not isinstance(tools, list) or len(tools) > limits.max_tools:
        raise bad(f"tools must be an array of at most {limits.max_tools} function tools", "tools", "invalid_type")
    try:
        size = len(json.dumps(tools))
    except (TypeError, ValueError, RecursionError):
        raise bad("tools must be plain JSON", "tools", "invalid_type") from None
    if size > limits.max_tools_chars:
        raise bad(f"tools hold {size} characters of JSON, more than {limits.max_tools_chars}", "tools")
    out = []
    for j, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not (isinstance(fn, dict) and tool.get("type") == "function" and isinstance(fn.get("name"), str)
                and TOOL_NAME.match(fn["name"]) and isinstance(fn.get("description", ""), str)
                and isinstance(fn.get("parameters", {}), dict)):
            raise bad(f'tools[{j}] must be {{"type": "function", "function": {{"name": 1-64 of A-Z a-z 0-9 _ -, '
                      '"description"?: str, "parameters"?: object}}}}', f"tools[{j}]", "invalid_type")
        out.append({"type": "function", "function": {k: fn[k] for k in ("name", "description", "parameters")
                                                     if k in fn}})
    if choice is None:
        return out, "auto"
    names = {t["function"]["name"] for t in out}
    if isinstance(choice, str) and choice in TOOL_CHOICES:
        if choice == "required" and not out:
            raise bad('tool_choice "required" needs tools', "tool_choice")
        return out, choice
    fn = choice.get("function") if isinstance(choice, dict) else None
    if isinstance(fn, dict) and choice.get("type") == "function" and isinstance(fn.get("name"), str) \
            and fn["name"] in names:
        return out, {"type": "function", "function": {"name": fn["name"]}}
    raise bad('tool_choice must be "auto", "none", "required" or {"type": "function", "function": {"name": NAME}} '
              "naming one of tools", "tool_choice")


def _stop(body: dict, limits: ApiLimits) -> list[str]:
    stop = body.get("stop")
    stops = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise bad("stop must be a non-empty string or an array of them", "stop", "invalid_type")
    if len(stops) > limits.max_stop or any(len(s) > limits.max_stop_chars for s in stops):
        raise bad(f"stop: at most {limits.max_stop} strings of at most {limits.max_stop_chars} characters", "stop")
    return stops


def _episode_id(body: dict, header: str | None) -> str:
    value = header if header else body.get("user")
    if value is None or value == "":
        return ""
    if not isinstance(value, str) or not EPISODE_ID.match(value):
        raise bad(f"episode id (X-Episode-Id header or user) must be 1-{MAX_SESSION_LEN} characters of "
                  "A-Z a-z 0-9 _ . : @ -", "user")
    return value


def _stream(body: dict) -> tuple[bool, bool]:
    """(stream, include_usage): `stream` a boolean; stream_options only with stream, holding only include_usage."""
    stream, options = body.get("stream"), body.get("stream_options")
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise bad(f"stream must be a boolean, got {type(stream).__name__}", "stream", "invalid_type")
    if options is None:
        return stream, False
    if not stream:
        raise bad("stream_options is only allowed with stream: true", "stream_options")
    if not isinstance(options, dict) or set(options) - {"include_usage"} or \
            not isinstance(options.get("include_usage", False), bool):
        raise bad('stream_options supports only {"include_usage": true|false}', "stream_options", "unsupported_value")
    return stream, options.get("include_usage", False)


def _check_unsupported(body: dict, limits: ApiLimits) -> None:
    for name in UNSUPPORTED:
        if body.get(name) not in (None, [], {}):
            raise bad(f"{name} is not supported by this endpoint", name, "unsupported_parameter")
    if _int(body, "top_logprobs", 0, 0, 20):
        raise bad("top_logprobs > 0 is not supported: the engines record only the sampled token's logprob; use "
                  "logprobs: true", "top_logprobs", "unsupported_value")


def parse_chat(body: Any, limits: ApiLimits, model: str, episode_header: str | None = None) -> ChatCall:
    """Validate a decoded /v1/chat/completions body; ApiError (400/404) names the first bad field."""
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object", None, "invalid_type")
    name = body.get("model")
    if not isinstance(name, str) or not name:
        raise bad("model is required (GET /v1/models lists it)", "model", "missing_required_parameter")
    if name != model:
        raise ApiError(404, f"the model {name[:200]!r} does not exist here; this endpoint serves {model!r}",
                       "model", "model_not_found")
    messages = parse_messages(body.get("messages"), limits)
    _check_unsupported(body, limits)
    logprobs = body.get("logprobs") or False
    if not isinstance(logprobs, bool):
        raise bad("logprobs must be a boolean", "logprobs", "invalid_type")
    max_tokens = _int(body, "max_completion_tokens", None, 1, limits.max_tokens)
    max_tokens = max_tokens or _int(body, "max_tokens", limits.default_max_tokens, 1, limits.max_tokens)
    n = _int(body, "n", 1, 1, limits.max_n)
    seed = _int(body, "seed", None, -(2 ** 63), 2 ** 63 - 1)
    spec = dict(temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
                top_p=_number(body, "top_p", 1.0, 0.0, 1.0, low_open=True),
                max_new_tokens=max_tokens, stop_strings=_stop(body, limits))
    samplings = [SamplingSpec(**spec, seed=None if seed is None else (seed + i) % 2 ** 63) for i in range(n)]
    tools, tool_choice = _tools(body, limits)
    if not isinstance(body.get("parallel_tool_calls", True), bool):
        raise bad("parallel_tool_calls must be a boolean", "parallel_tool_calls", "invalid_type")
    stream, include_usage = _stream(body)
    if stream and (n > 1 or logprobs):
        raise bad("stream: true supports n 1 without logprobs here; send stream: false for n > 1 or logprobs",
                  "n" if n > 1 else "logprobs", "unsupported_value")
    return ChatCall(messages, samplings, logprobs, _episode_id(body, episode_header), tools, tool_choice, stream,
                    include_usage)


def _logprobs(result: GenerateResult, decode: Callable[[list[int]], str]) -> dict:
    content = []
    for tok, lp in zip(result.output_ids.tolist(), result.logprobs.tolist()):
        text = decode([tok])
        content.append({"token": text, "logprob": lp, "bytes": list(text.encode("utf-8")), "top_logprobs": []})
    return {"content": content, "refusal": None}


def assistant_message(content: str | None, tool_calls: list[dict] | None = None) -> dict:
    msg = {"role": "assistant", "content": content, "refusal": None}
    if tool_calls:
        msg["tool_calls"] = tool_calls
    return msg


def chat_response(model: str, prompt_tokens: int, results: list[GenerateResult], want_logprobs: bool,
                  decode: Callable[[list[int]], str], messages: list[dict] | None = None) -> dict:
    """A `chat.completion` object for the n results of one call (in choice order); `messages[i]` replaces the
    plain-text assistant message of choice i (parsed tool calls: finish_reason tool_calls)."""
    choices = []
    for i, r in enumerate(results):
        msg = messages[i] if messages else assistant_message(r.text)
        reason = "tool_calls" if msg.get("tool_calls") else "length" if r.finish_reason == "length" else "stop"
        choices.append({"index": i, "message": msg, "finish_reason": reason,
                        "logprobs": _logprobs(r, decode) if want_logprobs else None})
    completion = sum(len(r.output_ids) for r in results)
    return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
            "model": model, "choices": choices, "system_fingerprint": None,
            "usage": usage(prompt_tokens, completion)}


def chunk(completion_id: str, model: str, created: int, delta: dict | None, finish_reason: str | None = None,
          usage: dict | None = None) -> dict:
    """One `chat.completion.chunk` of a streamed answer: a delta of choice 0, or (delta None) the usage chunk with no
    choices (stream_options.include_usage)."""
    doc = {"id": completion_id, "object": "chat.completion.chunk", "created": created, "model": model,
           "system_fingerprint": None,
           "choices": [] if delta is None else [{"index": 0, "delta": delta, "logprobs": None,
                                                 "finish_reason": finish_reason}]}
    if usage is not None:
        doc["usage"] = usage
    return doc


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def models_response(model: str, created: int) -> dict:
    return {"object": "list", "data": [{"id": model, "object": "model", "created": created, "owned_by": "areal-mq"}]}
