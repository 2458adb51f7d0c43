r"""Tool calls through the OpenAI endpoint: one family per way a model writes a call, chosen from its chat template.

What: a `ToolFamily` says how the endpoint offers tools to a model and reads its calls back:
  - qwen: the template renders `tools` itself (Qwen2.5, Qwen3, Hermes, SmolLM with such a template); the model
    writes `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`, one block per call.
  - llama3: the template renders `tools` itself (Llama 3.1/3.2/3.3); the model writes
    `{"name": ..., "parameters": {...}}` (optionally after `<|python_tag|>`, several joined by `;`).
  - prompted: the template knows no tools (SmolLM2's own): the endpoint lists the tools in the system message
    (PROMPTED_SYSTEM, the qwen form) and renders tool results as `<tool_response>` user text; qwen parsing.
  - prompted_bare: as `prompted`, and a call whose arguments are not a JSON object is read as the bare value of
    the function's one string parameter when it has exactly one (`{"name": "calculator", "arguments": 18 + 64}`
    -> {"expression": "18 + 64"}): what a small model without tool training writes (benchmarks/quality/RESULTS.md).
    Chosen by name only (`--tool-family prompted_bare`, the openai_agent workflow's `tool_family`), never by auto;
    each such call is counted in the episode record's `tool_repairs`.
  - none: tools are rendered as for `prompted`, nothing is parsed: the reply is always text.
`family_for(chat_template, name="auto")` picks one; `family.parse(text)` returns a ParsedReply: the content,
OpenAI `tool_calls` entries (ids `call_<hex>`), and `error` when text that opened a call was not a valid call
(the reply is then returned whole as text, finish_reason stop, and the error goes into the episode record).
`family.forced(name)` is the text that starts the reply for tool_choice "required" (name None) or a named
function: it goes into the prompt (environment tokens, never trained) and is prepended before parsing.
Why here: parsing never changes the trained tokens (they are the generated ids, whatever the parser did).
Run: pytest tests/unit/openai/test_toolcalls.py -q
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Callable

CALL_BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.S)
PYTHON_TAG = "<|python_tag|>"
PROMPTED_SYSTEM = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with "
    "function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\nFor each function call, "
    "return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n"
    "<tool_call>\n{{\"name\": <function-name>, \"arguments\": <args-json-object>}}\n</tool_call>")


@dataclass
class ParsedReply:
    content: str | None  # None when the reply is only tool calls
    tool_calls: list[dict] = field(default_factory=list)  # OpenAI entries {"id", "type", "function"}
    error: str = ""  # "" or why a call the text opened was not parsed (then content is the whole text)
    repaired: int = 0  # calls read as a bare argument (prompted_bare), counted in the episode record


def _entry(name: str, arguments: dict) -> dict:
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}}


def _call(body: str, args_key: str) -> tuple[dict | None, str]:
    """(entry, "") for a JSON object {"name": str, args_key: object or JSON-object string}; (None, reason) else."""
    try:
        call = json.loads(body)
    except (ValueError, RecursionError) as exc:
        return None, f"not JSON ({str(exc)[:120]})"
    if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not call["name"]:
        return None, 'not a JSON object with a string "name"'
    args = call.get(args_key, call.get("arguments", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except (ValueError, RecursionError):
            return None, f"{args_key} is a string that is not JSON"
    if not isinstance(args, dict):
        return None, f"{args_key} must be a JSON object"
    return _entry(call["name"], args), ""


def parse_qwen(text: str, bare_tools: list[dict] | None = None) -> ParsedReply:
    """`<tool_call>{json}</tool_call>` blocks (a last block cut before its closing tag is read too). With
    `bare_tools` (prompted_bare), a block that is not a valid call may be read as a bare argument (bare_call)."""
    bodies = CALL_BLOCK.findall(text)
    if not bodies:
        return ParsedReply(text)
    calls, why, repaired = _calls(bodies, "arguments", bare_tools)
    if why:
        return ParsedReply(text, [], why)
    rest = CALL_BLOCK.sub("", text).strip()
    return ParsedReply(rest or None, calls, "", repaired)


def parse_llama3(text: str) -> ParsedReply:
    """Llama 3.1's JSON form: the whole reply is `{"name", "parameters"}` objects joined by `;`."""
    body = text.strip()
    tagged = body.startswith(PYTHON_TAG)
    body = body[len(PYTHON_TAG):].strip() if tagged else body
    if not body.startswith("{"):
        return ParsedReply(text, [], "malformed_tool_call: <|python_tag|> without a JSON call" if tagged else "")
    parts = [p for p in body.split(";") if p.strip()] if _is_json_list(body) else [body]
    calls, why, _ = _calls(parts, "parameters")
    return ParsedReply(text, [], why) if why else ParsedReply(None, calls)


def _calls(bodies: list[str], args_key: str, bare_tools: list[dict] | None = None) -> tuple[list[dict], str, int]:
    """Every body as a `tool_calls` entry, or ([], the reason naming the first malformed call, 0): a reply is all
    calls or text, never half of each. With `bare_tools`, a body that is not a valid call is tried as a bare
    argument (bare_call); the third value counts those read so."""
    calls, repaired = [], 0
    for i, body in enumerate(bodies):
        entry, why = _call(body.strip(), args_key)
        if entry is None and bare_tools is not None:
            entry = bare_call(body.strip(), bare_tools)
            repaired += entry is not None
        if entry is None:
            return [], f"malformed_tool_call: call {i}: {why}", 0
        calls.append(entry)
    return calls, "", repaired


def _is_json_list(body: str) -> bool:
    """Several calls joined by `;` (one call's JSON may itself hold a `;` in a string: tried whole first)."""
    try:
        json.loads(body)
        return False
    except (ValueError, RecursionError):
        return ";" in body


def parse_none(text: str) -> ParsedReply:
    return ParsedReply(text)


BARE_CALL = re.compile(r'\s*\{\s*"name"\s*:\s*"([A-Za-z0-9_-]{1,64})"\s*,\s*"arguments"\s*:\s*(.*)', re.S)
MAX_BARE_CHARS = 2000  # a bare argument longer than this is not read as one


def string_parameter(tools: list[dict], name: str) -> str | None:
    """The one parameter of function `name` when it has exactly one and it is a string; else None."""
    for tool in tools:
        fn = tool.get("function") or {}
        if fn.get("name") != name:
            continue
        props = (fn.get("parameters") or {}).get("properties") or {}
        if isinstance(props, dict) and len(props) == 1:
            (key, spec), = props.items()
            if isinstance(spec, dict) and spec.get("type") == "string":
                return key
    return None


def bare_call(body: str, tools: list[dict]) -> dict | None:
    """A `<tool_call>` body `{"name": N, "arguments": VALUE}` whose VALUE is not a JSON object, read as N's one
    string parameter (the text up to the object's closing brace, a JSON string unquoted); None when it is not that."""
    m = BARE_CALL.fullmatch(body)
    if not m:
        return None
    key = string_parameter(tools, m.group(1))
    raw = m.group(2).strip()
    raw = raw[:-1].rstrip() if raw.endswith("}") else raw
    if key is None or not raw or raw.startswith("{") or len(raw) > MAX_BARE_CHARS:
        return None
    if raw.startswith('"'):
        try:
            value = json.loads(raw)
        except (ValueError, RecursionError):
            return None
        if not isinstance(value, str):
            return None
    else:
        value = raw
    return _entry(m.group(1), {key: value})


@dataclass(frozen=True)
class ToolFamily:
    name: str
    parse: Callable[[str], ParsedReply]
    template_tools: bool  # the chat template renders `tools` (else: PROMPTED_SYSTEM and <tool_response> text)
    required_prefix: str  # what starts the reply for tool_choice "required"
    named_prefix: str  # ... for a named function ({name} filled in)
    bare_arguments: bool = False  # read a one-string-parameter call's bare value (bare_call)
    # where a call opens in a streamed reply (streaming.py holds text back from it); None: a call cannot be told
    # from content before the reply ends, so a streamed reply with tools waits whole for its result
    call_marker: str | None = None

    def forced(self, tool_choice: str | dict) -> str:
        """The prompt text that forces a call ("" for auto / none)."""
        if isinstance(tool_choice, dict):
            return self.named_prefix.format(name=tool_choice["function"]["name"])
        return self.required_prefix if tool_choice == "required" else ""


QWEN_NAMED = '<tool_call>\n{{"name": "{name}", "arguments": '
FAMILIES: dict[str, ToolFamily] = {f.name: f for f in (
    ToolFamily("qwen", parse_qwen, True, "<tool_call>\n", QWEN_NAMED, call_marker="<tool_call>"),
    ToolFamily("llama3", parse_llama3, True, '{"name": "', '{{"name": "{name}", "parameters": '),
    ToolFamily("prompted", parse_qwen, False, "<tool_call>\n", QWEN_NAMED, call_marker="<tool_call>"),
    ToolFamily("prompted_bare", parse_qwen, False, "<tool_call>\n", QWEN_NAMED, bare_arguments=True,
               call_marker="<tool_call>"),
    ToolFamily("none", parse_none, False, "", ""),
)}


def family_for(chat_template: str | None, name: str = "auto") -> ToolFamily:
    """The family `name` names, or for "auto" the one the template's text shows (prompted when it has no tools)."""
    if name != "auto":
        if name not in FAMILIES:
            raise ValueError(f"unknown tool-call family {name!r}; known: auto, {', '.join(FAMILIES)}")
        return FAMILIES[name]
    template = chat_template or ""
    if "tools" not in template:
        return FAMILIES["prompted"]
    if PYTHON_TAG in template or "ipython" in template:
        return FAMILIES["llama3"]
    return FAMILIES["qwen"]


def parse_reply(family: ToolFamily, text: str, tools: list[dict]) -> ParsedReply:
    """`family.parse(text)`, or for prompted_bare the same qwen parsing reading bare arguments against `tools`."""
    return parse_qwen(text, tools) if family.bare_arguments else family.parse(text)
