"""Llama-family forward pass over a slot-based KV cache (the compute core of the torch engine).

What: `LlamaRunner` runs the decoder layers of a loaded Hugging Face Llama / Mistral / Qwen2 / Qwen3 model
directly on its parameters, on the device the model sits on, over a `SlotKVCache` (kvcache.py):

- `decode_step(k_cache, v_cache, tokens[B], positions[B], write_slots[B], length)`: the graph-ready step. One
  new token per row b, at its own position, its K/V written into slot write_slots[b]; queries of rows 0..B-1
  read the keys of slots 0..B-1 up to `length`. Only tensors in, logits [B, V] out: no host sync, no
  allocation that depends on values, so `torch.compile(fullgraph=True)` traces it in one graph and CUDA graphs
  capture it (graphs.py). `length` and B are Python ints fixed per bucket.
- `decode(cache, tokens, positions)`: the eager convenience over Python lists (exact batch and length).
- `extend(cache, slots, starts, chunks)`: write the KV of token chunks (prefill / recompute), no logits; one
  vectorised KV write per layer (index tensors built once on the host from the chunk lengths).

Every tensor made here is made on the runner's device (RoPE tables, index tensors, masks), so a model on
CUDA never meets a CPU index (tests/unit/engines/test_torch_device.py checks it with the model on `meta` under
areal_mq.testing.device_guard.DeviceGuard). Qwen3 adds a per-head RMSNorm of q and k before RoPE.

Why our own forward instead of `model.generate`: continuous batching needs per-sequence positions and
lengths in one batch, sequences joining and leaving between steps, and KV that survives an in-place
weight update. Driving the HF modules through their cache API costs more Python per layer than the
whole layer's math at these sizes; here each layer is 4 matmuls (q/k/v and gate/up fused), RoPE,
one SDPA call and two RMSNorms. The parameters stay the HF model's own tensors: the fused q/k/v and
gate/up matrices are single tensors and the HF parameters are re-pointed to views of them, so an
in-place `param.copy_(new)` (a weight update) lands in the fused matrices with no re-fusing, at the same
addresses (what a captured CUDA graph reads).

How to run: used by `areal_mq.engines.torch.engine`; tests in tests/unit/engines/test_torch_*.py check it
against the HF forward.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.nn.functional as F

from contiguous_engine.kvcache import SlotKVCache
from areal_mq.errors import ModelNotFound

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


@dataclass
class _Layer:
    ln1: torch.Tensor
    ln2: torch.Tensor
    qkv_w: torch.Tensor
    qkv_b: torch.Tensor | None
    o_w: torch.Tensor
    gate_up_w: torch.Tensor
    down_w: torch.Tensor
    q_norm: torch.Tensor | None = None  # qwen3: per-head RMSNorm of q and k before RoPE
    k_norm: torch.Tensor | None = None


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
    """Runs a loaded HF Llama-family causal LM over a SlotKVCache on the model's device (module docstring)."""

    def __init__(self, model: Any, max_len: int):
        cfg = model.config
        if cfg.model_type not in SUPPORTED_MODEL_TYPES:
            raise ModelNotFound(
                f"the torch engine supports model types {SUPPORTED_MODEL_TYPES}, got {cfg.model_type!r}; "
                f"use engine: vllm for other architectures (docs/engines.md)."
            )
        window = getattr(cfg, "sliding_window", None)
        if (window and window < max_len) or "sliding_attention" in (getattr(cfg, "layer_types", None) or ()):
            raise ModelNotFound(f"sliding-window attention ({window}) is not supported; "
                                f"set max_model_len <= {window}, or use engine: vllm.")
        self.model = model
        first = next(model.parameters())
        self.dtype, self.device = first.dtype, first.device
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
            pos = torch.arange(max_len, device=self.device).unsqueeze(0)
            cos, sin = inner.rotary_emb(torch.zeros(1, dtype=torch.float32, device=self.device), pos)
        self.cos, self.sin = cos[0].to(self.dtype), sin[0].to(self.dtype)  # [max_len, head_dim] on the device

    def _bind_layer(self, layer: Any) -> _Layer:
        attn, mlp = layer.self_attn, layer.mlp
        norms = (getattr(attn, "q_norm", None), getattr(attn, "k_norm", None))
        if getattr(mlp, "down_proj", None) is None or (norms[0] is None) != (norms[1] is None):
            raise ModelNotFound("unsupported decoder layer layout for the torch engine; use engine: vllm.")
        qkv = (attn.q_proj, attn.k_proj, attn.v_proj)
        return _Layer(
            ln1=layer.input_layernorm.weight, ln2=layer.post_attention_layernorm.weight,
            qkv_w=_fuse(qkv, "weight"), qkv_b=_fuse(qkv, "bias"), o_w=attn.o_proj.weight,
            gate_up_w=_fuse((mlp.gate_proj, mlp.up_proj), "weight"), down_w=mlp.down_proj.weight,
            q_norm=None if norms[0] is None else norms[0].weight, k_norm=None if norms[1] is None else norms[1].weight,
        )

    def new_cache(self, slots: int, capacity: int | None = None) -> SlotKVCache:
        """A cache for `slots` sequences (+ the scratch slot) on this runner's device; static if `capacity`."""
        return SlotKVCache(len(self.layers), slots, self.n_kv, self.head_dim, self.max_len, self.dtype,
                           device=self.device, capacity=capacity)

    def index(self, values: Sequence[int]) -> torch.Tensor:
        """An int64 index tensor on the runner's device from host ints (a host-to-device copy, never a sync)."""
        return torch.tensor(list(values), dtype=torch.long, device=self.device)

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
        q = qkv[..., : nq * hd].view(n, t, nq, hd)
        k = qkv[..., nq * hd : (nq + nkv) * hd].view(n, t, nkv, hd)
        v = qkv[..., (nq + nkv) * hd :].view(n, t, nkv, hd).transpose(1, 2)
        if layer.q_norm is not None:
            q = F.rms_norm(q, (hd,), layer.q_norm, self.eps)
            k = F.rms_norm(k, (hd,), layer.k_norm, self.eps)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        return self._rope(q.transpose(1, 2), cos, sin), self._rope(k.transpose(1, 2), cos, sin), v

    def _finish_layer(self, layer: _Layer, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """attn [N, T, H*hd] -> residual + MLP block."""
        x = x + F.linear(attn, layer.o_w)
        h = F.rms_norm(x, (self.hidden,), layer.ln2, self.eps)
        gate, up = F.linear(h, layer.gate_up_w).chunk(2, dim=-1)
        return x + F.linear(F.silu(gate) * up, layer.down_w)

    # -- entry points ----------------------------------------------------------------------------

    def decode_step(self, k_cache: torch.Tensor, v_cache: torch.Tensor, tokens: torch.Tensor,
                    positions: torch.Tensor, write_slots: torch.Tensor, length: int) -> torch.Tensor:
        """The graph-ready decode step (module docstring): float32 logits [B, V]; writes K/V in place.

        Every row's position must be < length <= the cache capacity (the caller checks on the host)."""
        b = tokens.shape[0]
        cos, sin = self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)  # [B, 1, hd]
        # key j of row i is visible iff j <= positions[i]: [B, 1, 1, L]
        keys_at = torch.arange(length, device=tokens.device)
        mask = (keys_at.unsqueeze(0) <= positions.unsqueeze(1)).view(b, 1, 1, length)
        groups = self.n_heads // self.n_kv
        x = F.embedding(tokens, self.embed).unsqueeze(1)  # [B, 1, D]
        for li, layer in enumerate(self.layers):
            q, k, v = self._qkv(layer, x, cos, sin)
            k_cache[li, write_slots, :, positions] = k[:, :, 0]
            v_cache[li, write_slots, :, positions] = v[:, :, 0]
            keys = k_cache[li, :b, :, :length]  # padding rows read real slots' KV; their output is dropped
            values = v_cache[li, :b, :, :length]
            # a single query per sequence: fold each KV head's query group into the query axis
            qg = q.reshape(b, self.n_kv, groups, self.head_dim)
            out = F.scaled_dot_product_attention(qg, keys, values, attn_mask=mask)
            x = self._finish_layer(layer, x, out.reshape(b, 1, self.n_heads * self.head_dim))
        x = F.rms_norm(x[:, 0], (self.hidden,), self.final_norm, self.eps)
        return F.linear(x, self.lm_head).float()

    @torch.inference_mode()
    def decode(self, cache: SlotKVCache, tokens: Sequence[int], positions: Sequence[int]) -> torch.Tensor:
        """One token per sequence in slots 0..B-1 at `positions` (host ints); float32 logits [B, V]."""
        length = max(positions) + 1  # from host ints: no sync
        cache.ensure(length)
        return self.decode_step(cache.k, cache.v, self.index(tokens), self.index(positions),
                                torch.arange(len(tokens), device=self.device), length)

    @torch.inference_mode()
    def extend(self, cache: SlotKVCache, slots: Sequence[int], starts: Sequence[int],
               chunks: Sequence[Sequence[int]], want_logits: bool = False) -> torch.Tensor | None:
        """Write KV for token `chunks[i]` of the sequence in `slots[i]` at positions starts[i]...

        Chunks are right-padded into one batch. With want_logits, returns float32 logits [N, V] of
        each chunk's last token (used by tests; the engine samples from decode()).
        """
        n, t = len(chunks), max(len(c) for c in chunks)
        lens = [len(c) for c in chunks]
        length = max(s + m for s, m in zip(starts, lens))
        cache.ensure(length)
        padded = [list(c) + [0] * (t - len(c)) for c in chunks]
        tokens = self.index([tok for row in padded for tok in row]).view(n, t)
        pos = (self.index(starts).unsqueeze(1) + torch.arange(t, device=self.device)).clamp(max=self.max_len - 1)
        cos, sin = self.cos[pos], self.sin[pos]
        mask = (torch.arange(length, device=self.device).view(1, 1, length) <= pos.unsqueeze(2)).unsqueeze(1)
        slot_idx = self.index(slots)
        # the real (unpadded) tokens, flattened: row i's j-th token goes to slot slots[i], position starts[i] + j
        w_row = self.index([i for i, m in enumerate(lens) for _ in range(m)])
        w_t = self.index([j for m in lens for j in range(m)])
        w_slot = self.index([s for s, m in zip(slots, lens) for _ in range(m)])
        w_pos = self.index([st + j for st, m in zip(starts, lens) for j in range(m)])
        x = F.embedding(tokens, self.embed)
        for li, layer in enumerate(self.layers):
            q, k, v = self._qkv(layer, x, cos, sin)
            cache.k[li, w_slot, :, w_pos] = k[w_row, :, w_t]  # one write per layer, every chunk at once
            cache.v[li, w_slot, :, w_pos] = v[w_row, :, w_t]
            keys = cache.k[li, slot_idx, :, :length]
            values = cache.v[li, slot_idx, :, :length]
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True)
            x = self._finish_layer(layer, x, out.transpose(1, 2).reshape(n, t, -1))
        if not want_logits:
            return None
        last = x[torch.arange(n, device=self.device), self.index(lens) - 1]
        last = F.rms_norm(last, (self.hidden,), self.final_norm, self.eps)
        return F.linear(last, self.lm_head).float()
