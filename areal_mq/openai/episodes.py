"""Episode recording for the OpenAI-compatible endpoint: what the model said, token by token, per episode.

What: `EpisodeRecorder` keeps, for each episode id (the `X-Episode-Id` header or the request's `user`
field), its turns in order: the prompt token ids the chat template produced, and per choice the generated
token ids, behaviour logprobs, per-token policy versions and finish reason. `pop(id)` hands an episode to
a workflow (or `GET/DELETE /v1/episodes/{id}` over HTTP); `Episode.to_segments()` turns it into one
trainable sequence as plain lists: prompt and environment tokens with version -1 and loss mask 0,
generated tokens with their version, behaviour logprob and mask 1.

Why bounded: any HTTP client can open episodes, so the recorder caps episodes (least recently used out),
turns per episode, tokens per episode and in all, and forgets episodes idle past a TTL. A turn that would
break a cap is not recorded; the episode says so (`dropped_turns`), the response is still served.

Single sequence: turn k+1 continues turn k when its prompt starts with turn k's prompt + output. The
endpoint builds it that way (prompts.py: previous prompt ids + generated ids + the new messages' tokens) when
the client's history is what was served; the tokens in between are the environment's (masked). A turn the
endpoint had to render fresh (the client edited history, changed tools; `split` names the reason and the first
differing message) starts a new sequence: `to_sequences()` splits there and `to_segments()` raises
NotOneSequence. `audit()` checks every turn: the trained tokens equal the generated ones, in the context (the
prompt) they were generated from; `to_json()` carries it per turn and in sum.
Run: pytest tests/unit/test_openai_episodes.py -q
"""
from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np

from areal_mq.errors import ArealError


class NotOneSequence(ArealError):
    """An episode whose turns do not extend each other cannot be packed as one trained sequence."""


@dataclass(frozen=True)
class RecorderLimits:
    max_episodes: int = 256  # least recently used episode out when one more starts
    max_turns: int = 64  # per episode; later turns are counted in dropped_turns, not stored
    max_episode_tokens: int = 1 << 17  # prompt + output tokens stored per episode (prompts repeat per turn)
    max_total_tokens: int = 1 << 23  # over all episodes; oldest episodes out first
    ttl_s: float = 3600.0  # an episode untouched this long is forgotten


@dataclass
class Choice:
    """One generated completion of a turn. output_ids/logprobs/versions  # [T] int32/float32/int32"""

    output_ids: np.ndarray
    logprobs: np.ndarray
    versions: np.ndarray
    finish_reason: str
    tool_calls: int = 0  # calls parsed out of its text (the tokens stay as generated)
    tool_error: str = ""  # why text that opened a tool call was returned as text (toolcalls.ParsedReply.error)
    tool_repairs: int = 0  # of tool_calls, those read as a bare argument (the prompted_bare family)

    def to_json(self) -> dict:
        return {"output_ids": self.output_ids.tolist(), "logprobs": self.logprobs.tolist(),
                "versions": self.versions.tolist(), "finish_reason": self.finish_reason,
                "tool_calls": self.tool_calls, "tool_error": self.tool_error, "tool_repairs": self.tool_repairs}


@dataclass
class Served:
    """What the endpoint served an episode's last turn, so the next turn can extend its tokens (prompts.py)."""

    message_keys: list[str]  # per request message, prompts.message_key
    tools_key: str  # prompts.tools_key of the request's tools
    prompt_ids: np.ndarray  # [P] int32
    replies: list[tuple[str, np.ndarray]]  # per choice: message_key of the assistant message answered, output ids


@dataclass
class RecordedTurn:
    """One chat completion call: its prompt (chat-templated)  # [P] int32, and its n choices."""

    prompt_ids: np.ndarray
    choices: list[Choice]
    created: float = 0.0
    origin: str = "fresh"  # "fresh" | "continued" (prompt = previous prompt + output + new) | "split"
    split_reason: str = ""  # why a later turn was rendered fresh: edited_history, tools_changed, ...
    edit_at: int = -1  # the first request message that differed from what was served (-1: none / n.a.)

    def tokens(self) -> int:
        return len(self.prompt_ids) + sum(len(c.output_ids) for c in self.choices)

    def to_json(self) -> dict:
        return {"prompt_ids": self.prompt_ids.tolist(), "created": self.created, "origin": self.origin,
                "split_reason": self.split_reason, "edit_at": self.edit_at,
                "choices": [c.to_json() for c in self.choices]}


@dataclass
class RecordedEpisode:
    episode_id: str
    turns: list[RecordedTurn] = field(default_factory=list)
    dropped_turns: int = 0
    touched: float = 0.0
    served: Served | None = None  # the last turn served (recorded or not), for the next turn's prompt

    def tokens(self) -> int:
        return sum(t.tokens() for t in self.turns)

    def to_sequences(self) -> list[list[dict]]:
        """Segments, split into sequences wherever a turn's prompt does not extend the previous turn.

        Each segment: {"kind": "prompt"|"env"|"generated", "turn": k, "tokens", "logprobs", "versions",
        "loss_mask"} with plain lists. Of a turn's choices, the one the next prompt continues is used
        (choice 0 when none does, and for the last turn)."""
        sequences: list[list[dict]] = []
        prev: np.ndarray | None = None  # previous turn's prompt + chosen output
        for k, turn in enumerate(self.turns):
            nxt = self.turns[k + 1].prompt_ids if k + 1 < len(self.turns) else None
            choice = _continued_choice(turn, nxt)
            p = turn.prompt_ids
            extends = prev is not None and len(p) >= len(prev) and np.array_equal(p[:len(prev)], prev)
            if extends and turn.origin != "split":
                if len(p) > len(prev):
                    sequences[-1].append(_plain("env", k, p[len(prev):]))
            else:
                sequences.append([_plain("prompt", k, p)])
            sequences[-1].append(_generated(k, choice))
            prev = np.concatenate([p, choice.output_ids])
        return sequences

    def to_segments(self) -> list[dict]:
        """The episode as ONE sequence (see to_sequences); NotOneSequence when it is several."""
        seqs = self.to_sequences()
        if len(seqs) > 1:
            starts = [seq[0]["turn"] for seq in seqs[1:]]
            raise NotOneSequence(
                f"episode {self.episode_id!r} is {len(seqs)} sequences: the prompts of turns {starts} do not start "
                "with the previous turn's prompt + output (history edited, or the assistant text re-tokenized "
                "differently); train them as separate sequences with to_sequences()")
        return seqs[0] if seqs else []

    def audit(self) -> list[dict]:
        """Per turn: generated and trained token counts, and `exact`: the trained tokens are the generated ids
        and the sequence before them is the prompt they were generated from."""
        out = []
        for seq in self.to_sequences():
            context: list[int] = []
            for seg in seq:
                if seg["kind"] == "generated":
                    turn = self.turns[seg["turn"]]
                    nxt = self.turns[seg["turn"] + 1].prompt_ids if seg["turn"] + 1 < len(self.turns) else None
                    gen = _continued_choice(turn, nxt).output_ids.tolist()
                    trained = [t for t, m in zip(seg["tokens"], seg["loss_mask"]) if m]
                    out.append({"turn": seg["turn"], "generated": len(gen), "trained": len(trained),
                                "exact": trained == gen and context == turn.prompt_ids.tolist()})
                context += seg["tokens"]
        return out

    def to_json(self) -> dict:
        seqs, audit = self.to_sequences(), self.audit()
        turns = [{**t.to_json(), "audit": a} for t, a in zip(self.turns, audit)]
        splits = [{"turn": k, "reason": t.split_reason, "message": t.edit_at}
                  for k, t in enumerate(self.turns) if t.origin == "split"]
        summary = {"turns": len(audit), "generated_tokens": sum(a["generated"] for a in audit),
                   "trained_tokens": sum(a["trained"] for a in audit),
                   "exact_turns": sum(a["exact"] for a in audit),
                   "continued_turns": sum(t.origin == "continued" for t in self.turns), "splits": splits}
        return {"episode_id": self.episode_id, "turns": turns, "dropped_turns": self.dropped_turns,
                "single_sequence": len(seqs) <= 1, "sequence_starts": [seq[0]["turn"] for seq in seqs],
                "audit": summary}


def _continued_choice(turn: RecordedTurn, next_prompt: np.ndarray | None) -> Choice:
    if next_prompt is not None:
        for c in turn.choices:
            full = np.concatenate([turn.prompt_ids, c.output_ids])
            if len(next_prompt) >= len(full) and np.array_equal(next_prompt[:len(full)], full):
                return c
    return turn.choices[0]


def _plain(kind: str, turn: int, tokens: np.ndarray) -> dict:
    n = len(tokens)
    return {"kind": kind, "turn": turn, "tokens": tokens.tolist(), "logprobs": [0.0] * n,
            "versions": [-1] * n, "loss_mask": [0] * n}


def _generated(turn: int, c: Choice) -> dict:
    n = len(c.output_ids)
    return {"kind": "generated", "turn": turn, "tokens": c.output_ids.tolist(), "logprobs": c.logprobs.tolist(),
            "versions": c.versions.tolist(), "loss_mask": [1] * n}


class EpisodeRecorder:
    """Thread-safe, bounded map episode id -> RecordedEpisode (HTTP handler threads record; a workflow pops)."""

    def __init__(self, limits: RecorderLimits | None = None, clock=time.monotonic):
        self.limits = limits or RecorderLimits()
        self._clock = clock
        self._episodes: OrderedDict[str, RecordedEpisode] = OrderedDict()  # least recently touched first
        self._tokens = 0
        self._lock = threading.Lock()
        self.evicted = 0

    def record(self, episode_id: str, turn: RecordedTurn, served: Served | None = None) -> int:
        """Append `turn` (and keep `served` for the next turn's prompt); returns its index, or -1 when a cap
        refused it (counted in dropped_turns)."""
        lim, now = self.limits, self._clock()
        with self._lock:
            self._expire(now)
            ep = self._episodes.pop(episode_id, None) or RecordedEpisode(episode_id)
            ep.touched = now
            ep.served = served if served is not None else ep.served
            self._episodes[episode_id] = ep
            n = turn.tokens()
            if len(ep.turns) >= lim.max_turns or ep.tokens() + n > lim.max_episode_tokens:
                ep.dropped_turns += 1
                return -1
            turn.created = turn.created or time.time()
            ep.turns.append(turn)
            self._tokens += n
            while len(self._episodes) > lim.max_episodes or (self._tokens > lim.max_total_tokens
                                                              and len(self._episodes) > 1):
                self._drop(next(iter(self._episodes)))
            return len(ep.turns) - 1

    def served(self, episode_id: str) -> Served | None:
        """What the episode's last turn served (None: a new episode, or forgotten)."""
        with self._lock:
            self._expire(self._clock())
            ep = self._episodes.get(episode_id)
            return ep.served if ep is not None else None

    def get(self, episode_id: str) -> RecordedEpisode | None:
        with self._lock:
            self._expire(self._clock())
            return self._episodes.get(episode_id)

    def pop(self, episode_id: str) -> RecordedEpisode | None:
        """Take the episode out (a workflow finished it); None when unknown, expired or evicted."""
        with self._lock:
            self._expire(self._clock())
            ep = self._episodes.pop(episode_id, None)
            if ep is not None:
                self._tokens -= ep.tokens()
            return ep

    def stats(self) -> dict:
        with self._lock:
            return {"episodes": len(self._episodes), "tokens": self._tokens, "evicted": self.evicted}

    def _drop(self, episode_id: str) -> None:
        ep = self._episodes.pop(episode_id)
        self._tokens -= ep.tokens()
        self.evicted += 1

    def _expire(self, now: float) -> None:
        while self._episodes:
            oldest_id, oldest = next(iter(self._episodes.items()))
            if now - oldest.touched <= self.limits.ttl_s:
                return
            self._drop(oldest_id)
