"""The inference-engine contract every rollout engine implements.

What: `Engine` is the interface the rollout worker drives — submit requests, step, collect finished
outputs carrying per-token ids, behaviour logprobs and policy versions, update weights in place at a
step boundary, pause/resume, abort. Two implementations: `torch` (embedded, default) and `vllm`.
Why: nothing outside `areal_mq/engines/` may depend on which engine runs; the rollout worker only
sees these types.

Logprob convention (shared with the trainer): the behaviour logprob of a sampled token is
log_softmax(logits / temperature)[token], i.e. temperature-scaled logits BEFORE top-p/top-k
truncation. With temperature == 0 (greedy) the logprob is log_softmax(logits)[token].
"""
from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Any, Mapping

import numpy as np

from areal_mq.errors import EngineRequestError

FINISH_REASONS = ("stop", "length", "abort")


@dataclass
class SamplingParams:
    """Sampling settings of one request. temperature 0 means greedy.

    Stopping: at the tokenizer's EOS (unless ignore_eos), at any of stop_token_ids (the stopping token
    is kept in output_ids), when the text contains a stop string (text is cut before it), or after
    max_new_tokens. seed: a per-request random stream, so the tokens do not depend on batch mates.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = disabled
    max_new_tokens: int = 256
    stop_token_ids: list[int] = field(default_factory=list)
    stop_strings: list[str] = field(default_factory=list)
    seed: int | None = None
    ignore_eos: bool = False  # keep generating past the tokenizer's EOS (stop_token_ids still stop)

    def validate(self) -> None:
        """Raise EngineRequestError naming the bad field."""
        if not (self.temperature >= 0.0):
            raise EngineRequestError(f"temperature must be >= 0, got {self.temperature}")
        if not (0.0 < self.top_p <= 1.0):
            raise EngineRequestError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise EngineRequestError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if self.max_new_tokens < 1:
            raise EngineRequestError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise EngineRequestError(f"stop_token_ids must be non-negative ints, got {self.stop_token_ids}")
        if any(not isinstance(s, str) or not s for s in self.stop_strings):
            raise EngineRequestError(f"stop_strings must be non-empty strings, got {self.stop_strings}")


@dataclass
class EngineRequest:
    """One sequence to generate. prompt_ids: [P] token ids (already chat-templated)."""

    request_id: str
    prompt_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)


@dataclass
class EngineOutput:
    """A finished (or aborted) sequence.

    output_ids  # [T] int32 generated token ids
    logprobs    # [T] float32 behaviour logprob of each generated token (see module docstring)
    versions    # [T] int32 policy version that sampled each token
    """

    request_id: str
    prompt_ids: list[int]
    output_ids: np.ndarray
    logprobs: np.ndarray
    versions: np.ndarray
    finish_reason: str  # one of FINISH_REASONS
    text: str = ""
    stats: dict[str, Any] = field(default_factory=dict)


class Engine(abc.ABC):
    """Interface of an inference engine (see module docstring).

    Single-threaded contract: the rollout worker calls every method from one thread. `step()` runs
    (at most) one decoding step over all running sequences and returns the sequences that finished.
    Weight updates happen between steps, which is what makes generation interruptible.
    """

    version: int = 0

    @abc.abstractmethod
    def submit(self, request: EngineRequest) -> None:
        """Queue a request; raises EngineRequestError (clear message) for a bad one."""

    @abc.abstractmethod
    def step(self) -> list[EngineOutput]:
        """Advance all running sequences by one step; return those that finished."""

    @abc.abstractmethod
    def has_work(self) -> bool:
        """True while any request is waiting or running."""

    @abc.abstractmethod
    def update_weights(
        self,
        version: int,
        tensors: Mapping[str, Any] | None = None,
        path: str | None = None,
    ) -> dict[str, float]:
        """Load new weights in place (from tensors or a safetensors dir) and stamp later tokens with
        `version`. In-flight sequences continue (KV recomputed or kept per `kv_on_update`).
        Returns timings, e.g. {"load_s": ..., "pause_s": ...}."""

    @abc.abstractmethod
    def abort(self, request_id: str) -> EngineOutput | None:
        """Stop one request; return its partial output (finish_reason "abort") or None if unknown."""

    def pause(self) -> None:  # noqa: B027 - optional
        """Stop stepping until resume(); running requests keep their state."""

    def resume(self) -> None:  # noqa: B027 - optional
        """Undo pause()."""

    @abc.abstractmethod
    def stats(self) -> dict[str, Any]:
        """running, waiting, tokens_per_s, kv_tokens, kv_bytes, version, ..."""

    def close(self) -> None:  # noqa: B027 - optional
        """Release resources."""
