"""The torch engine's slot KV cache: K and V of every layer for `slots` sequences plus one scratch slot, on one device.

What: `SlotKVCache` holds k / v as [layers, slots + 1, kv_heads, capacity, head_dim] on the engine's device. Slot
`slots` (the last one, `scratch`) belongs to no sequence: the padding rows of a bucketed decode step write their
KV there, so a batch padded up to its bucket never touches a real sequence's KV.

Two ways to size the time axis (`capacity`):
- static (`capacity` given, see `static_capacity`): allocated once, never moved. A captured CUDA graph keeps the
  addresses of k / v, so the cache of a graph-replayed decode step must be static. `kv_cache_bytes` (engine
  config) is the memory budget it is sized from.
- growing (`capacity=None`): starts at 128 positions and doubles up to `max_len` when the engine asks for more
  (`ensure`, called on the host before a step, never inside it). The CPU default: memory follows what is used.
Why one class: the engine, session KV (session.py) and the forward pass read and write it the same way either way.
"""
from __future__ import annotations

import torch

from areal_mq.errors import ConfigError

GROW_FROM = 128  # first capacity of a growing cache
MIN_STATIC = 16  # a static cache that cannot hold this many tokens per slot is a configuration mistake


def bytes_per_token(layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """K and V of one token over all layers."""
    return 2 * layers * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


def static_capacity(budget_bytes: int, slots: int, per_token: int, max_len: int) -> int:
    """Positions per slot a static cache of `budget_bytes` holds for `slots` sequences + the scratch slot
    (at most max_len); ConfigError when that is under MIN_STATIC."""
    capacity = min(max_len, budget_bytes // ((slots + 1) * per_token))
    if capacity < MIN_STATIC:
        raise ConfigError(
            f"kv_cache_bytes={budget_bytes} holds {capacity} tokens per slot for {slots} slots + 1 scratch slot "
            f"({per_token} bytes per token); raise kv_cache_bytes to at least {(slots + 1) * per_token * MIN_STATIC} "
            f"or lower max_concurrent")
    return capacity


class SlotKVCache:
    """K/V for `slots` sequences + 1 scratch slot on `device`; static when `capacity` is given (module docstring)."""

    def __init__(self, layers: int, slots: int, kv_heads: int, head_dim: int, max_len: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu", capacity: int | None = None):
        self.max_len = max_len
        self.static = capacity is not None
        self.capacity = min(capacity, max_len) if self.static else min(GROW_FROM, max_len)
        self.scratch = slots
        shape = (layers, slots + 1, kv_heads, self.capacity, head_dim)
        # zeros, not empty: masked keys still meet V in the softmax product, and garbage may be NaN
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)

    @property
    def device(self) -> torch.device:
        return self.k.device

    def ensure(self, length: int) -> None:
        """Make room for `length` positions: a growing cache doubles (on its own device), a static one refuses."""
        if length <= self.capacity:
            return
        if self.static or length > self.max_len:
            raise ValueError(f"sequence length {length} exceeds the KV cache limit "
                             f"{self.capacity if self.static else self.max_len}")
        new_cap = self.capacity
        while new_cap < length:
            new_cap *= 2
        new_cap = min(new_cap, self.max_len)
        for name in ("k", "v"):
            old = getattr(self, name)
            shape = list(old.shape)
            shape[3] = new_cap
            grown = torch.zeros(shape, dtype=old.dtype, device=old.device)
            grown[:, :, :, : self.capacity] = old
            setattr(self, name, grown)
        self.capacity = new_cap

    def move(self, src: int, dst: int, length: int, start: int = 0) -> None:
        """Copy positions [start, start + length) of slot src into slot dst (slot compaction, shared prefill)."""
        if length > 0 and src != dst:
            end = start + length
            with torch.inference_mode():  # the cache tensors may be inference tensors (grown while decoding)
                self.k[:, dst, :, start:end] = self.k[:, src, :, start:end]
                self.v[:, dst, :, start:end] = self.v[:, src, :, start:end]

    @property
    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2
