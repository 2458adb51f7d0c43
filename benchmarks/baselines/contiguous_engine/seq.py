"""Per-sequence state of the torch engine: tokens so far, stop checks, and the finished output.

What: `SeqState` holds one request's prompt + generated tokens, their behaviour logprobs and policy
versions, how much of it has KV (`kv_len`), its random stream and its stop conditions.
`SeqState.append` records a sampled token and says whether (and why) the sequence is finished;
`build_output` turns it into the EngineOutput the rollout worker sends on.

Stop semantics: a sequence stops ("stop") at the tokenizer's EOS unless `ignore_eos`, at any of
`stop_token_ids`, or when its decoded text contains one of `stop_strings`; it stops ("length") at
`max_new_tokens`. The stopping token is kept in output_ids (the trainer needs every sampled token);
with a stop string, `text` is cut just before it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from areal_mq.engines.base import EngineOutput, EngineRequest


@dataclass(eq=False)
class SeqState:
    request: EngineRequest
    tokens: list[int]  # prompt + generated
    n_prompt: int
    stop_ids: frozenset[int]
    reserved: int  # KV tokens reserved: prompt + max_new_tokens
    generator: torch.Generator | None
    submitted_at: float
    kv_len: int = 0  # tokens[:kv_len] have KV in the cache
    kv_sig: int = 0  # hash of how that KV was made (tokens, weight versions): equal sig = identical KV
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    first_token_at: float | None = None
    stop_string: str | None = None
    kv_reused: int = 0  # prompt tokens whose KV came from the session's previous turn (session.py)

    @property
    def ready(self) -> bool:
        """KV covers every token but the last, which the next decode step feeds."""
        return self.kv_len == len(self.tokens) - 1

    def advance_kv(self, tokens: list[int], version: int) -> None:
        """KV for `tokens` (the next ones after kv_len) was written under weights `version`."""
        self.kv_len += len(tokens)
        self.kv_sig = hash((self.kv_sig, version, tuple(tokens)))

    def reset_kv(self) -> None:
        self.kv_len, self.kv_sig = 0, 0

    @property
    def output_ids(self) -> list[int]:
        return self.tokens[self.n_prompt :]

    def append(self, token: int, logprob: float, version: int, now: float, tokenizer: Any) -> str | None:
        """Record a sampled token; return a finish reason ("stop" / "length") or None."""
        self.tokens.append(token)
        self.logprobs.append(logprob)
        self.versions.append(version)
        if self.first_token_at is None:
            self.first_token_at = now
        sp = self.request.sampling
        if token in self.stop_ids:
            return "stop"
        if sp.stop_strings and self._hit_stop_string(tokenizer):
            return "stop"
        if len(self.logprobs) >= sp.max_new_tokens:
            return "length"
        return None

    def _hit_stop_string(self, tokenizer: Any) -> bool:
        # a stop string of L characters ends within the last L tokens (every token is >= 1 char),
        # plus a few for multi-byte characters split across tokens
        window = max(len(s) for s in self.request.sampling.stop_strings) + 4
        tail = tokenizer.decode(self.output_ids[-window:], skip_special_tokens=True)
        for s in self.request.sampling.stop_strings:
            if s in tail:
                self.stop_string = s
                return True
        return False


def build_output(seq: SeqState, reason: str, tokenizer: Any) -> EngineOutput:
    """The EngineOutput of a finished or aborted sequence."""
    out = seq.output_ids
    text = tokenizer.decode(out, skip_special_tokens=True) if out else ""
    if seq.stop_string is not None and seq.stop_string in text:
        text = text[: text.index(seq.stop_string)]
    now_stats: dict[str, Any] = {"prompt_tokens": seq.n_prompt, "output_tokens": len(out)}
    if seq.first_token_at is not None:
        now_stats["ttft_s"] = seq.first_token_at - seq.submitted_at
    if seq.request.session:
        now_stats["prefill_tokens_saved"] = seq.kv_reused
    return EngineOutput(
        request_id=seq.request.request_id, prompt_ids=list(seq.tokens[: seq.n_prompt]),
        output_ids=np.asarray(out, dtype=np.int32), logprobs=np.asarray(seq.logprobs, dtype=np.float32),
        versions=np.asarray(seq.versions, dtype=np.int32), finish_reason=reason, text=text, stats=now_stats,
    )
