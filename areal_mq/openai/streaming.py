"""`stream: true` on /v1/chat/completions: partial tokens from the rollout worker -> `chat.completion.chunk` events.

What: `TextStream` turns the token ids of one answer, as they arrive in GeneratePartials, into content deltas:
it decodes the ids so far (as the engine decodes the final text: special tokens skipped) and hands out only text
that cannot change any more: never half of a multi-byte character (a trailing U+FFFD waits for its next token),
never a prefix of a stop string (the final text is cut before it), and, when the reply may be a tool call, nothing
from the family's call opening (`<tool_call>`) on, nor trailing blanks before it. `finish(content)` returns what is
left of the final content (the parsed reply's, exactly as the non-streamed answer has it).
`chunks(...)` is the event sequence of one streamed call: a role chunk, content deltas, then from the final
GenerateResult (the source of truth: the episode record and the training data come from it, as without stream)
the rest of the content, the tool_calls deltas (index, id, type, name, arguments: each call whole in one delta)
and the finish chunk; with include_usage a last chunk with usage and no choices.
Why the final result decides: a weight update mid-answer only changes the versions of later tokens (one stream,
one answer); a job requeued to another worker after a loss starts again (`start` 0): its text is not resent, and
if a sampled rerun differs from what was sent the client keeps the first text while the record keeps the answer
(logged as openai.stream_diverged). Tool calls are parsed from the final text only, as without stream.
Tests: pytest tests/unit/openai/test_streaming.py -q
"""
from __future__ import annotations

from typing import Any, Callable, Iterator

from areal_mq.messages import GeneratePartial, GenerateResult

class TextStream:
    """Content deltas of one answer from its token ids; `decode(ids)` must skip special tokens like the engine."""

    def __init__(self, decode: Callable[[list[int]], str], stops: list[str] = (), call_marker: str | None = None,
                 hold_all: bool = False):
        self.decode, self.stops, self.marker, self.hold_all = decode, list(stops), call_marker, hold_all
        self.ids: list[int] = []
        self.sent = ""

    def feed(self, part: GeneratePartial) -> str:
        """The new safe text after `part`'s tokens ("" when nothing is safe yet)."""
        if part.start > len(self.ids):  # a partial was lost: wait for the result
            return ""
        self.ids[part.start:] = part.output_ids.tolist()
        if self.hold_all:
            return ""
        safe = self._safe(self.decode(self.ids))
        if len(safe) <= len(self.sent) or not safe.startswith(self.sent):
            return ""  # a requeued rerun that differs so far: nothing more until the result
        new, self.sent = safe[len(self.sent):], safe
        return new

    def _safe(self, text: str) -> str:
        text = text.rstrip("\ufffd")  # an incomplete multi-byte character at the end
        cut = len(text)
        for s in self.stops + ([self.marker] if self.marker else []):
            at = text.find(s)
            if at >= 0:
                cut = min(cut, at)
            else:  # an end that may still grow into it
                k = next((k for k in range(min(len(s) - 1, len(text)), 0, -1) if text.endswith(s[:k])), 0)
                cut = min(cut, len(text) - k)
        text = text[:cut]
        return text.rstrip() if self.marker else text

    def finish(self, content: str | None) -> tuple[str, bool]:
        """(what is left of the final content to send, whether what was sent is its prefix)."""
        content = content or ""
        if content.startswith(self.sent):
            return content[len(self.sent):], True
        return "", False


def chunks(make: Callable[..., dict], events: Iterator[GeneratePartial | GenerateResult], text: TextStream,
           finish: Callable[[GenerateResult], tuple[Any, dict | None]], prompt_tokens: int, include_usage: bool,
           usage: Callable[[int, int], dict], on_diverged: Callable[[], None] | None = None) -> Iterator[dict]:
    """The chunk objects of one streamed call. `make(delta, finish_reason=None, usage=None)` renders a chunk;
    `finish(result)` parses the final result into (ParsedReply, its assistant message) and records the episode."""
    try:
        yield make({"role": "assistant", "content": ""})
        for event in events:
            if isinstance(event, GeneratePartial):
                if delta := text.feed(event):
                    yield make({"content": delta})
                continue
            yield from _end(make, event, text, finish, prompt_tokens, include_usage, usage, on_diverged)
    finally:  # a client gone mid-stream: the job is cancelled and forgotten
        getattr(events, "close", lambda: None)()


def _end(make: Callable[..., dict], event: GenerateResult, text: TextStream,
         finish: Callable[[GenerateResult], tuple[Any, dict | None]], prompt_tokens: int, include_usage: bool,
         usage: Callable[[int, int], dict], on_diverged: Callable[[], None] | None) -> Iterator[dict]:
    """The chunks from the final result: rest of the content, tool_calls, finish, usage."""
    parsed, message = finish(event)
    rest, same = text.finish(parsed.content)
    if not same and on_diverged is not None:
        on_diverged()
    if rest:
        yield make({"content": rest})
    calls = message.get("tool_calls") or []
    for i, call in enumerate(calls):
        yield make({"tool_calls": [{"index": i, "id": call["id"], "type": "function",
                                    "function": {"name": call["function"]["name"],
                                                 "arguments": call["function"]["arguments"]}}]})
    reason = "tool_calls" if calls else "length" if event.finish_reason == "length" else "stop"
    yield make({}, finish_reason=reason)
    if include_usage:
        yield make(None, usage=usage(prompt_tokens, len(event.output_ids)))
