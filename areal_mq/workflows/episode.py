"""The trace of one multi-turn episode: every token after the first prompt, with who wrote it.

What: `Episode(prompt_ids)` then, in order, `add_generated(ids, logprobs, versions)` for a model turn and
`add_env(ids)` for anything the environment writes (feedback, a tool's output, the next user turn's chat
markup). `to_seq(reward)` is the SeqSample the trainer packs as ONE sequence:

    prompt_ids                      output_ids = turn 1 | env | turn 2 | env | turn 3
    (context, never trained)        loss_mask  = 1 1 1  | 0 0 | 1 1    | 0   | 1 1 1
                                    versions   = 3 3 4  |-1-1 | 4 4    | -1  | 5 5 5   (per token)
                                    logprobs   = b b b  | 0 0 | b b    | 0   | b b b   (behaviour)

Why: exact per-token bookkeeping. Generated tokens keep the version and behaviour logprob the rollout engine
stamped on each of them (a turn that spans a weight update carries two versions); environment tokens carry
version -1 and mask 0, so the loss never trains on text the model did not write, and the episode's
staleness is that of its oldest GENERATED token (`oldest_version`). Pure data: no sockets, no model.
Run: pytest tests/unit/workflows/test_episode.py -q
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from areal_mq.messages import MAX_EPISODE_TOKENS, SeqSample


class EpisodeTooLong(ValueError):
    """The episode grew past its token budget (agent.max_episode_tokens, at most MAX_EPISODE_TOKENS)."""


@dataclass
class Segment:
    """One run of tokens written by one party. ids/logprobs/versions  # [n]."""

    generated: bool
    ids: np.ndarray
    logprobs: np.ndarray
    versions: np.ndarray


@dataclass
class Episode:
    prompt_ids: list[int]
    max_tokens: int = MAX_EPISODE_TOKENS
    segments: list[Segment] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.prompt_ids:
            raise ValueError("an episode needs at least one prompt token (its first generated token needs context)")
        self.max_tokens = min(self.max_tokens, MAX_EPISODE_TOKENS)

    # ------------------------------------------------------------ building
    def add_generated(self, ids: Sequence[int], logprobs: Sequence[float], versions: Sequence[int]) -> None:
        ids, lp, ver = (np.asarray(ids, np.int32), np.asarray(logprobs, np.float32), np.asarray(versions, np.int32))
        if not (len(ids) == len(lp) == len(ver)):
            raise ValueError(f"a turn needs one logprob and version per token: {len(ids)}, {len(lp)}, {len(ver)}")
        if len(ver) and int(ver.min()) < 0:
            raise ValueError("generated tokens carry the policy version that sampled them (>= 0)")
        self._append(Segment(True, ids, lp, ver))

    def add_env(self, ids: Sequence[int]) -> None:
        ids = np.asarray(ids, np.int32)
        self._append(Segment(False, ids, np.zeros(len(ids), np.float32), np.full(len(ids), -1, np.int32)))

    def _append(self, seg: Segment) -> None:
        if len(seg.ids) == 0:
            return
        if self.n_output + len(seg.ids) > self.max_tokens:
            raise EpisodeTooLong(f"episode would hold {self.n_output + len(seg.ids)} tokens after its prompt, "
                                 f"over its budget of {self.max_tokens}")
        self.segments.append(seg)

    # ------------------------------------------------------------ reading
    @property
    def n_output(self) -> int:
        return sum(len(s.ids) for s in self.segments)

    @property
    def turns(self) -> int:
        return sum(1 for s in self.segments if s.generated)

    @property
    def token_ids(self) -> list[int]:
        """The whole sequence so far: the next turn's prompt."""
        return [*self.prompt_ids, *(int(t) for s in self.segments for t in s.ids)]

    def _cat(self, attr: str, dtype: str) -> np.ndarray:
        parts = [getattr(s, attr) for s in self.segments]
        return np.concatenate(parts).astype(dtype) if parts else np.zeros(0, dtype)

    @property
    def loss_mask(self) -> np.ndarray:
        return np.concatenate([np.full(len(s.ids), int(s.generated), np.uint8) for s in self.segments]) \
            if self.segments else np.zeros(0, np.uint8)

    def oldest_version(self) -> int:
        """Oldest policy version among generated tokens (-1: nothing generated)."""
        ver = self._cat("versions", "int32")
        gen = ver[ver >= 0]
        return int(gen.min()) if gen.size else -1

    def to_seq(self, reward: float, finish_reason: str = "stop", info: dict | None = None) -> SeqSample:
        return SeqSample(prompt_ids=np.asarray(self.prompt_ids, np.int32), output_ids=self._cat("ids", "int32"),
                         logprobs=self._cat("logprobs", "float32"), versions=self._cat("versions", "int32"),
                         loss_mask=self.loss_mask, reward=float(reward), finish_reason=finish_reason,
                         info=dict(info or {}))
