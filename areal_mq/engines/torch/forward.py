"""Llama-family forward pass over a slot-based KV cache (the compute core of the torch engine).

What: `SlotKVCache` holds K and V for every layer as [layers, slots, kv_heads, capacity, head_dim]
(capacity grows by doubling up to `max_len`); `LlamaRunner` runs the decoder layers of a loaded
Hugging Face Llama/Mistral/Qwen2 model directly on its parameters:

- `decode(tokens[B], positions[B])`: one new token for each of the sequences in slots 0..B-1, each at
  its own position; returns next-token logits [B, V].
- `extend(slots, starts, chunks)`: write the KV of token chunks (prefill / recompute), no logits.

Why our own forward instead of `model.generate`: continuous batching needs per-sequence positions and
lengths in one batch, sequences joining and leaving between steps, and KV that survives an in-place
weight update. Driving the HF modules through their cache API costs more Python per layer than the
whole layer's math at these sizes; here each layer is 4 matmuls (q/k/v and gate/up fused), RoPE,
one SDPA call and two RMSNorms. The parameters stay the HF model's own tensors: the fused q/k/v and
gate/up matrices are single tensors and the HF parameters are re-pointed to views of them, so an
in-place `param.copy_(new)` (a weight update) lands in the fused matrices with no re-fusing.

How to run: used by `areal_mq.engines.torch.engine`; `tests/unit/engines/test_torch_forward.py`
checks it against the HF forward.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.nn.functional as F

from areal_mq.errors import ModelNotFound

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")


class SlotKVCache:
    """Preallocated K/V for `slots` sequences; capacity (time axis) grows on demand up to max_len."""

    def __init__(self, layers: int, slots: int, kv_heads: int, head_dim: int, max_len: int,
                 dtype: torch.dtype, initial: int = 128):
        self.max_len = max_len
        self.capacity = min(initial, max_len)
        shape = (layers, slots, kv_heads, self.capacity, head_dim)
        self.k = torch.zeros(shape, dtype=dtype)
        self.v = torch.zeros(shape, dtype=dtype)

    def ensure(self, length: int) -> None:
        """Make room for `length` positions (doubling), copying what is there."""
        if length <= self.capacity:
            return
        if length > self.max_len:
            raise ValueError(f"sequence length {length} exceeds the KV cache limit {self.max_len}")
        new_cap = self.capacity
        while new_cap < length:
            new_cap *= 2
        new_cap = min(new_cap, self.max_len)
        for name in ("k", "v"):
            old = getattr(self, name)
            shape = list(old.shape)
            shape[3] = new_cap
            grown = torch.zeros(shape, dtype=old.dtype)
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


@dataclass
class _Layer:
    ln1: torch.Tensor
    ln2: torch.Tensor
    qkv_w: torch.Tensor
    qkv_b: torch.Tensor | None
    o_w: torch.Tensor
    gate_up_w: torch.Tensor
    down_w: torch.Tensor


def _fuse(linears: Sequence[Any], attr: str) -> torch.Tensor | None:
    """Concatenate the `attr` tensors of `linears` and re-point each module's parameter at a view."""
    parts = [getattr(m, attr) for m in linears]
    if any(p is None for p in parts):
        return None
    fused = torch.cat([p.detach() for p in parts], dim=0)
    offset = 0
    for m, p in zip(linears, parts):
        n = p.shape[0]
        p.data = fused[offset : offset + n]  # the parameter object stays, its storage is the fused one
        offset += n
    return fused


class LlamaRunner:
    """Runs a loaded HF Llama-family causal LM over a SlotKVCache (see module docstring)."""

    def __init__(self, model: Any, max_len: int):
        cfg = model.config
        if cfg.model_type not in SUPPORTED_MODEL_TYPES:
            raise ModelNotFound(
                f"the torch engine supports model types {SUPPORTED_MODEL_TYPES}, got {cfg.model_type!r}; "
                f"use engine: vllm for other architectures."
            )
        if getattr(cfg, "sliding_window", None) and cfg.sliding_window < max_len:
            raise ModelNotFound(f"sliding-window attention ({cfg.sliding_window}) is not supported; "
                                f"set max_model_len <= {cfg.sliding_window}.")
        self.model = model
        self.dtype = next(model.parameters()).dtype
        self.n_heads = cfg.num_attention_heads
        self.n_kv = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.hidden = cfg.hidden_size
        self.eps = cfg.rms_norm_eps
        self.vocab_size = cfg.vocab_size
        self.max_len = max_len
        self.layers = [self._bind_layer(layer) for layer in model.model.layers]
        inner = model.model
        self.embed = inner.embed_tokens.weight
        self.final_norm = inner.norm.weight
        self.lm_head = model.lm_head.weight  # the embedding itself when tied
        with torch.no_grad():
            pos = torch.arange(max_len).unsqueeze(0)
            cos, sin = inner.rotary_emb(torch.zeros(1, dtype=torch.float32), pos)
        self.cos, self.sin = cos[0].to(self.dtype), sin[0].to(self.dtype)  # [max_len, head_dim]

    def _bind_layer(self, layer: Any) -> _Layer:
        attn, mlp = layer.self_attn, layer.mlp
        if getattr(mlp, "down_proj", None) is None or getattr(attn, "q_norm", None) is not None:
            raise ModelNotFound("unsupported decoder layer layout for the torch engine; use engine: vllm.")
        qkv = (attn.q_proj, attn.k_proj, attn.v_proj)
        return _Layer(
            ln1=layer.input_layernorm.weight, ln2=layer.post_attention_layernorm.weight,
            qkv_w=_fuse(qkv, "weight"), qkv_b=_fuse(qkv, "bias"), o_w=attn.o_proj.weight,
            gate_up_w=_fuse((mlp.gate_proj, mlp.up_proj), "weight"), down_w=mlp.down_proj.weight,
        )

    def new_cache(self, slots: int) -> SlotKVCache:
        return SlotKVCache(len(self.layers), slots, self.n_kv, self.head_dim, self.max_len, self.dtype)

    # -- helpers ---------------------------------------------------------------------------------

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin

    def _qkv(self, layer: _Layer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """x [N, T, D] -> q [N, H, T, hd], k/v [N, KV, T, hd] with RoPE applied (cos/sin [N, T, hd])."""
        n, t, _ = x.shape
        h = F.rms_norm(x, (self.hidden,), layer.ln1, self.eps)
        qkv = F.linear(h, layer.qkv_w, layer.qkv_b)
        hd, nq, nkv = self.head_dim, self.n_heads, self.n_kv
        q = qkv[..., : nq * hd].view(n, t, nq, hd).transpose(1, 2)
        k = qkv[..., nq * hd : (nq + nkv) * hd].view(n, t, nkv, hd).transpose(1, 2)
        v = qkv[..., (nq + nkv) * hd :].view(n, t, nkv, hd).transpose(1, 2)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        return self._rope(q, cos, sin), self._rope(k, cos, sin), v

    def _finish_layer(self, layer: _Layer, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """attn [N, T, H*hd] -> residual + MLP block."""
        x = x + F.linear(attn, layer.o_w)
        h = F.rms_norm(x, (self.hidden,), layer.ln2, self.eps)
        gate, up = F.linear(h, layer.gate_up_w).chunk(2, dim=-1)
        return x + F.linear(F.silu(gate) * up, layer.down_w)

    # -- entry points ----------------------------------------------------------------------------

    @torch.inference_mode()
    def decode(self, cache: SlotKVCache, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """One token per sequence in slots 0..B-1 at `positions` [B]; returns float32 logits [B, V]."""
        b = tokens.shape[0]
        length = int(positions.max()) + 1
        cache.ensure(length)
        rows = torch.arange(b)
        cos, sin = self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)  # [B, 1, hd]
        # key j of row i is visible iff j <= positions[i]: [B, 1, 1, L]
        mask = (torch.arange(length).unsqueeze(0) <= positions.unsqueeze(1)).view(b, 1, 1, length)
        groups = self.n_heads // self.n_kv
        x = F.embedding(tokens, self.embed).unsqueeze(1)  # [B, 1, D]
        for li, layer in enumerate(self.layers):
            q, k, v = self._qkv(layer, x, cos, sin)
            cache.k[li, rows, :, positions] = k[:, :, 0]
            cache.v[li, rows, :, positions] = v[:, :, 0]
            keys = cache.k[li, :b, :, :length]
            values = cache.v[li, :b, :, :length]
            # a single query per sequence: fold each KV head's query group into the query axis
            qg = q.reshape(b, self.n_kv, groups, self.head_dim)
            out = F.scaled_dot_product_attention(qg, keys, values, attn_mask=mask)
            x = self._finish_layer(layer, x, out.reshape(b, 1, self.n_heads * self.head_dim))
        x = F.rms_norm(x[:, 0], (self.hidden,), self.final_norm, self.eps)
        return F.linear(x, self.lm_head).float()

    @torch.inference_mode()
    def extend(self, cache: SlotKVCache, slots: Sequence[int], starts: Sequence[int],
               chunks: Sequence[Sequence[int]], want_logits: bool = False) -> torch.Tensor | None:
        """Write KV for token `chunks[i]` of the sequence in `slots[i]` at positions starts[i]...

        Chunks are right-padded into one batch. With want_logits, returns float32 logits [N, V] of
        each chunk's last token (used by tests; the engine samples from decode()).
        """
        n, t = len(chunks), max(len(c) for c in chunks)
        lens = torch.tensor([len(c) for c in chunks])
        start = torch.tensor(list(starts))
        length = int((start + lens).max())
        cache.ensure(length)
        tokens = torch.zeros(n, t, dtype=torch.long)
        for i, c in enumerate(chunks):
            tokens[i, : len(c)] = torch.tensor(list(c), dtype=torch.long)
        pos = (start.unsqueeze(1) + torch.arange(t).unsqueeze(0)).clamp(max=self.max_len - 1)  # [N, T]
        cos, sin = self.cos[pos], self.sin[pos]
        mask = (torch.arange(length).view(1, 1, length) <= pos.unsqueeze(2)).unsqueeze(1)  # [N,1,T,L]
        slot_idx = torch.tensor(list(slots))
        x = F.embedding(tokens, self.embed)
        for li, layer in enumerate(self.layers):
            q, k, v = self._qkv(layer, x, cos, sin)
            for i, (s, st) in enumerate(zip(slots, starts)):
                m = int(lens[i])
                cache.k[li, s, :, st : st + m] = k[i, :, :m]
                cache.v[li, s, :, st : st + m] = v[i, :, :m]
            keys = cache.k[li, slot_idx, :, :length]
            values = cache.v[li, slot_idx, :, :length]
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True)
            x = self._finish_layer(layer, x, out.transpose(1, 2).reshape(n, t, -1))
        if not want_logits:
            return None
        last = x[torch.arange(n), lens - 1]
        last = F.rms_norm(last, (self.hidden,), self.final_norm, self.eps)
        return F.linear(last, self.lm_head).float()
