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

from areal_mq.messages import SamplingSpec

FINISH_REASONS = ("stop", "length", "abort")


@dataclass
class EngineRequest:
    """One sequence to generate. prompt_ids: [P] token ids (already chat-templated).

    session: the multi-turn episode it is a turn of (GenerateRequest.session, "" = none). An engine may keep a
    finished turn's KV for the session's next turn (the torch engine: torch/session.py); the output must not
    depend on it.
    """

    request_id: str
    prompt_ids: list[int]
    sampling: SamplingSpec = field(default_factory=SamplingSpec)
    session: str = ""


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

    # True where update_weights also takes patches= (name -> (flat positions, values)): only the elements a weight
    # delta changed, written in place (the torch engine); other engines get the full state dict.
    accepts_patches: bool = False
    # True where update_weights also takes adapter= (a LoRA version staged by stage_adapter(tensors, scaling), merged
    # from the kept base: the torch engine); WeightsReady.adapter versions go to such engines (docs/protocol.md).
    accepts_adapters: bool = False

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

    def progress(self, request_id: str) -> tuple[list[int], list[float], list[int]] | None:
        """The tokens a running request has generated so far: (ids, logprobs, versions), or None (unknown,
        finished, or an engine that cannot tell: the rollout worker then streams nothing before the result).
        Read between steps, from the stepping thread; the lists may be the engine's own: do not modify them."""
        return None

    def pause(self) -> None:  # noqa: B027 - optional
        """Stop stepping until resume(); running requests keep their state."""

    def resume(self) -> None:  # noqa: B027 - optional
        """Undo pause()."""

    @abc.abstractmethod
    def stats(self) -> dict[str, Any]:
        """running, waiting, tokens_per_s, kv_tokens, kv_bytes, version, ..."""

    def close(self) -> None:  # noqa: B027 - optional
        """Release resources."""
