"""Partial outputs of streamed generate requests (GenerateRequest.stream, the OpenAI endpoint's `stream: true`).

What: `StreamedRequests` remembers which running requests asked to stream and how many of their tokens were sent;
after each engine step the rollout worker calls `due(now)`, which reads `engine.progress(request id)` for the
requests whose interval has passed and returns one GeneratePartial per request with new tokens (the tokens since
the last partial, their logprobs and per-token versions, `start` and `seq`).
Why bounded: one partial per request at most every STREAM_INTERVAL_S, each of at most MAX_PARTIAL_TOKENS tokens
(the rest waits for the next one), so a fast engine cannot flood the broker; the GenerateResult that ends the job
still carries every token (partials are a view). A weight update mid-answer changes the versions of the tokens
after it, nothing else: the same request keeps streaming.
Training traffic never sets `stream`, so this costs it nothing.
Tests: pytest tests/unit/workers/test_rollout_stream.py -q
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from areal_mq.messages import MAX_PARTIAL_TOKENS, GeneratePartial

STREAM_INTERVAL_S = 0.05  # at most one partial per streamed request this often (20 a second)


@dataclass
class _Stream:
    job: Any
    sent: int = 0  # tokens already sent in partials
    seq: int = 0
    last: float = float("-inf")  # when the last partial was sent


class StreamedRequests:
    """Running streamed requests -> what was sent of each. Used from the rollout worker's stepping thread."""

    def __init__(self, progress: Callable[[str], Any], interval_s: float = STREAM_INTERVAL_S,
                 max_tokens: int = MAX_PARTIAL_TOKENS):
        self.progress, self.interval_s, self.max_tokens = progress, interval_s, max_tokens
        self.running: dict[str, _Stream] = {}

    def __len__(self) -> int:
        return len(self.running)

    def started(self, job: Any) -> None:
        if getattr(job.msg, "stream", False):
            self.running[job.id] = _Stream(job)

    def finished(self, request_id: str) -> None:
        self.running.pop(request_id, None)

    def due(self, now: float) -> list[tuple[Any, GeneratePartial]]:
        """(job, partial) for each streamed request whose interval passed and that has tokens not sent yet."""
        out = []
        for rid, s in self.running.items():
            if now - s.last < self.interval_s:
                continue
            got = self.progress(rid)
            if got is None or len(got[0]) <= s.sent:
                continue
            ids, logprobs, versions = got
            end = min(len(ids), s.sent + self.max_tokens)
            out.append((s.job, GeneratePartial(output_ids=list(ids[s.sent:end]), logprobs=list(logprobs[s.sent:end]),
                                               versions=list(versions[s.sent:end]), start=s.sent, seq=s.seq)))
            s.sent, s.seq, s.last = end, s.seq + 1, now
        return out
