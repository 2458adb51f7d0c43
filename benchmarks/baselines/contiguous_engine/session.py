"""Session KV of the torch engine: a finished turn's KV kept for the next turn of the same session.

What: when a request with `EngineRequest.session` finishes, the engine hands its KV (the tokens that have
KV, and a copy of their K/V rows) to `SessionKV.keep`. When a later request of the same session is admitted,
`SessionKV.take` returns that entry; the engine copies the rows of the longest common token prefix into the
new request's slot and prefills only the rest. Multi-turn episodes (turn k+1 = turn k's prompt + output +
environment text) then prefill only the new text.

Why a copy and not a held slot: a kept entry never occupies a decoding slot, so admission never waits for
it; its memory is bounded on its own (`session_kv_max_tokens`, least recently kept evicted first) and by
time (`session_kv_ttl_s`). Each kept token costs 2 * layers * kv_heads * head_dim * dtype bytes
(SmolLM2-135M in float32: 46 KiB), so 8,192 tokens are ~370 MiB there.

Exactness: KV at position i depends only on tokens[:i+1] and the weights, so the reused rows are the rows a
fresh prefill would write (up to float summation order: chunked prefill and one-token decode add in
different orders, ~1e-7 relative). Weights: with `kv_on_update: recompute` every entry is dropped when the
weights change (the kept KV is stale); with `keep` entries survive, as in-flight KV does.
"""
from __future__ import annotations

import collections
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch


@dataclass
class KeptKV:
    """One session's kept KV: tokens[:n] have K/V rows k/v [layers, kv_heads, n, head_dim]."""

    tokens: list[int]
    k: torch.Tensor
    v: torch.Tensor
    kv_sig: int
    kept_at: float

    def __len__(self) -> int:
        return len(self.tokens)


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of two token lists."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class SessionKV:
    """Kept KV per session, bounded in total tokens (LRU) and in age (see module docstring)."""

    def __init__(self, max_tokens: int, ttl_s: float, clock: Callable[[], float] = time.monotonic):
        self.max_tokens, self.ttl_s, self.clock = max_tokens, ttl_s, clock
        self.entries: collections.OrderedDict[str, KeptKV] = collections.OrderedDict()  # oldest first
        self.tokens = 0
        self.counters = collections.Counter()

    @property
    def enabled(self) -> bool:
        return self.max_tokens > 0 and self.ttl_s > 0

    def keep(self, session: str, tokens: list[int], k: torch.Tensor, v: torch.Tensor, kv_sig: int) -> None:
        """Keep `tokens`' K/V rows (already copied out of the slot) for the session's next turn."""
        self._drop(session)
        if not self.enabled or not tokens or len(tokens) > self.max_tokens:
            return
        self.entries[session] = KeptKV(list(tokens), k, v, kv_sig, self.clock())
        self.tokens += len(tokens)
        self.counters["session_kv_kept"] += 1
        self.expire()
        while self.tokens > self.max_tokens:
            oldest = next(iter(self.entries))
            self._drop(oldest)
            self.counters["session_kv_evicted"] += 1

    def take(self, session: str) -> KeptKV | None:
        """The session's kept KV (removed: the new turn owns it and keeps its own when it finishes)."""
        self.expire()
        entry = self.entries.get(session)
        if entry is not None:
            self._drop(session)
        return entry

    def expire(self) -> None:
        """Drop entries kept longer than ttl_s ago (the oldest are first)."""
        deadline = self.clock() - self.ttl_s
        while self.entries:
            session, entry = next(iter(self.entries.items()))
            if entry.kept_at > deadline:
                return
            self._drop(session)
            self.counters["session_kv_expired"] += 1

    def clear(self) -> None:
        """The weights changed under kv_on_update=recompute: every kept KV is stale."""
        self.counters["session_kv_stale"] += len(self.entries)
        self.entries.clear()
        self.tokens = 0

    def _drop(self, session: str) -> None:
        entry = self.entries.pop(session, None)
        if entry is not None:
            self.tokens -= len(entry)

    def stats(self) -> dict[str, int]:
        return {"session_kv_entries": len(self.entries), "session_kv_tokens": self.tokens, **self.counters}

    # -- the engine's side: copying rows between a slot of the SlotKVCache and a kept entry ------

    def save(self, cache: Any, slot: int, seq: Any) -> None:
        """Keep the KV of finished sequence `seq` (slot `slot`): its tokens[:kv_len] and their rows."""
        n = seq.kv_len
        with torch.inference_mode():
            k, v = cache.k[:, slot, :, :n].clone(), cache.v[:, slot, :, :n].clone()
        self.keep(seq.request.session, seq.tokens[:n], k, v, seq.kv_sig)

    def restore(self, cache: Any, slot: int, seq: Any) -> int:
        """Copy the session's kept rows of the prefix it shares with new sequence `seq` into `slot`; set
        seq.kv_len and return it (0: nothing kept, or nothing shared).

        At least two prompt tokens stay unreused: the last one is decode's input, and one goes through the
        ordinary prefill path, so the row joins the slot layout as a pending row like any other."""
        entry = self.take(seq.request.session)
        if entry is None:
            self.counters["session_kv_misses"] += 1
            return 0
        n = min(common_prefix(entry.tokens, seq.tokens), len(seq.tokens) - 2)
        if n <= 0:
            self.counters["session_kv_misses"] += 1
            return 0
        cache.ensure(n)
        with torch.inference_mode():
            cache.k[:, slot, :, :n] = entry.k[:, :, :n]
            cache.v[:, slot, :, :n] = entry.v[:, :, :n]
        seq.kv_len = n
        seq.kv_sig = hash(("session-kv", entry.kv_sig, n))  # rows 0..n-1 of that history: shareable only alike
        return n
