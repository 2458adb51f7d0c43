"""Prompt token ids for the OpenAI endpoint: a fresh chat-template render, or the exact continuation of an episode.

What: `PromptBuilder.build(call, served)` returns a Prompt (token ids + how they were made). Without an episode,
or on its first turn, the messages (and tools) are rendered with the model's chat template (`fresh`). On a later
turn whose history is exactly what this endpoint served (the same messages, then the assistant message one of
the last turn's choices answered, then new messages, with the same `tools`), the prompt is

    previous prompt ids + that choice's generated ids + tail ids          (`continued`)

where the tail is only what the template writes after an assistant message's content: its end-of-turn marker
(left out when the model generated an end-of-turn special token itself) and the new messages, with the
generation prompt. The tail is found by rendering the history with a sentinel in place of the assistant's
content and taking the text after it, so it is the same rule for every template (SmolLM2's ChatML, Qwen2.5 and
Qwen3, Llama 3.1): earlier turns are never rendered again, whatever the template would do to them (Qwen3 drops
earlier <think> blocks, Qwen2.5 re-writes tool calls with its own JSON spacing), and generated text is never
re-tokenized. A history that differs from what was served (`split`: an edited or missing message, or other
tools) is rendered fresh, and the episode records the turn as the start of a new sequence with the reason and the
first differing message.
Why: the trained tokens must be the generated ones, in the context they were generated in (docs/openai.md).
Tools: a family whose template renders `tools` gets them through `apply_chat_template(tools=...)`; otherwise the
tool list goes into the system message and tool results become `<tool_response>` user text (toolcalls.py).
tool_choice "none" renders no tools; "required" / a named function add the family's forced prefix after the
generation prompt (environment tokens, so enforced for the call's start; the arguments are only prompted).
"""
from __future__ import annotations

import hashlib
import json
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np

from areal_mq.openai.api import ApiError, ChatCall
from areal_mq.openai.episodes import Served
from areal_mq.openai.toolcalls import PROMPTED_SYSTEM, ToolFamily

SENTINEL = "AREALMQ7f3aSENTINELc41e"  # stands for an assistant's content when the tail of a history is rendered


@dataclass
class Prompt:
    ids: list[int]
    origin: str  # "fresh" (no earlier turn) | "continued" | "split" (rendered fresh: history differs)
    forced: str = ""  # text appended after the generation prompt (tool_choice required / named)
    split_reason: str = ""  # "edited_history" | "tools_changed" | "reply_not_served" | "no_new_message"
    edit_at: int = -1  # first request message that differs from what was served
    choice: int = -1  # the previous turn's choice this prompt continues


def _canonical_args(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except (ValueError, RecursionError):
        return arguments


def message_key(msg: dict) -> str:
    """What a message renders as (role, content, tool calls by name and arguments, parsed): the ids the client
    echoes or invents for tool calls do not reach the model, and re-serialized arguments are the same call."""
    calls = [(c["function"]["name"], _canonical_args(c["function"]["arguments"])) for c in msg.get("tool_calls") or ()]
    doc = [msg.get("role"), msg.get("content") or "", calls]
    return hashlib.sha256(json.dumps(doc, sort_keys=True, ensure_ascii=False).encode()).hexdigest()[:32]


def tools_key(tools: list[dict]) -> str:
    return hashlib.sha256(json.dumps(tools, sort_keys=True).encode()).hexdigest()[:32]


class PromptBuilder:
    """Renders prompts for one tokenizer and tool family; thread-safe (one lock around the tokenizer)."""

    def __init__(self, tokenizer: Any, family: ToolFamily, lock: threading.Lock | None = None):
        self.tokenizer, self.family = tokenizer, family
        self.lock = lock or threading.Lock()
        self._special = set(getattr(tokenizer, "all_special_ids", []) or [])

    def build(self, call: ChatCall, served: Served | None) -> Prompt:
        messages, tools = call.messages, call.tools if call.tool_choice != "none" else []
        forced = self.family.forced(call.tool_choice) if call.tools else ""
        if served is None:
            return Prompt(self._fresh(messages, tools) + self._encode(forced), "fresh", forced)
        keys = [message_key(m) for m in messages]
        k = len(served.message_keys)
        reason, edit_at, choice = self._match(call, served, keys)
        if reason:
            return Prompt(self._fresh(messages, tools) + self._encode(forced), "split", forced, reason, edit_at)
        history = [*messages[:k], {"role": "assistant", "content": SENTINEL}, *messages[k + 1:]]
        out = served.replies[choice][1]
        ids = [*served.prompt_ids.tolist(), *out.tolist(), *self._tail(history, tools, out)]
        return Prompt(ids + self._encode(forced), "continued", forced, choice=choice)

    def _match(self, call: ChatCall, served: Served, keys: list[str]) -> tuple[str, int, int]:
        """("", -1, choice) when the request continues what was served; else (reason, first differing message, -1)."""
        k = len(served.message_keys)
        for i, (a, b) in enumerate(zip(keys, served.message_keys)):
            if a != b:
                return "edited_history", i, -1
        if len(keys) <= k:
            return "edited_history", len(keys), -1
        replies = [key for key, _ in served.replies]
        if keys[k] not in replies:
            return "reply_not_served", k, -1
        if tools_key(call.tools) != served.tools_key:
            return "tools_changed", -1, -1
        if len(keys) == k + 1:
            return "no_new_message", -1, -1
        return "", -1, replies.index(keys[k])

    def _tail(self, history: list[dict], tools: list[dict], out: np.ndarray) -> list[int]:
        text = self._render(history, tools)
        at = text.rfind(SENTINEL)
        if at < 0:
            raise ApiError(400, "the chat template dropped the assistant message it was given, so the next turn cannot "
                           "extend the generated tokens; send it as a new episode", "messages", "template_unsupported")
        tail = self._encode(text[at + len(SENTINEL):])
        if len(out) and int(out[-1]) in self._special and tail and tail[0] in self._special:
            tail = tail[1:]  # the model wrote its end-of-turn token; the template's would be a second one
        return tail

    def _fresh(self, messages: list[dict], tools: list[dict]) -> list[int]:
        return self._encode(self._render(messages, tools))

    def _encode(self, text: str) -> list[int]:
        if not text:
            return []
        with self.lock:
            return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def _render(self, messages: list[dict], tools: list[dict]) -> str:
        msgs = self._prepare(messages, tools)
        kwargs = {"tools": tools} if tools and self.family.template_tools else {}
        try:
            with self.lock:
                return self.tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True, **kwargs)
        except Exception as exc:  # a template may refuse an order of roles (raise_exception in Jinja)
            raise ApiError(400, f"the chat template refused these messages: {str(exc)[:300]}", "messages") from None

    def _prepare(self, messages: list[dict], tools: list[dict]) -> list[dict]:
        """Messages as the template takes them: tool-call arguments as objects for templates that render tools,
        calls and results as `<tool_call>` / `<tool_response>` text (and the tools in the system message) else."""
        if self.family.template_tools:
            return [_with_object_args(m) for m in messages]
        out = [_as_text(m) for m in messages]
        if tools:
            listing = PROMPTED_SYSTEM.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))
            if out and out[0]["role"] == "system":
                out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + listing}
            else:
                out.insert(0, {"role": "system", "content": listing})
        return out


def _with_object_args(msg: dict) -> dict:
    if not msg.get("tool_calls"):
        return msg
    calls = [{**c, "function": {"name": c["function"]["name"],
                                "arguments": _canonical_args(c["function"]["arguments"])}} for c in msg["tool_calls"]]
    return {**msg, "tool_calls": calls}


def _as_text(msg: dict) -> dict:
    if msg["role"] == "tool":
        return {"role": "user", "content": f"<tool_response>\n{msg['content']}\n</tool_response>"}
    if msg.get("tool_calls"):
        calls = "".join(f'\n<tool_call>\n{{"name": {json.dumps(c["function"]["name"])}, "arguments": '
                        f'{c["function"]["arguments"]}}}\n</tool_call>' for c in msg["tool_calls"])
        return {"role": "assistant", "content": (msg["content"] or "") + calls}
    return {"role": msg["role"], "content": msg["content"]}
