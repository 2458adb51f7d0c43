"""Llama-family forward pass over a paged KV cache (the compute core of the torch engine).

What: `LlamaRunner` runs the decoder layers of a loaded Hugging Face Llama / Mistral / Qwen2 / Qwen3 model
directly on its parameters, on the device the model sits on, over a `PagedKVCache` (kvcache.py: a block pool,
a block table per sequence):

- `decode_step(k_pool, v_pool, tokens[B], positions[B], tables[B, nb])`: the graph-ready step. One new token per
  row b, at its own position, its K/V written into its block tables[b, pos // bs] at offset pos % bs; row b's
  query reads the keys of its own blocks only (gathered, nb * block_size keys, masked past its position). Only
  tensors in, logits [B, V] out: no host sync, no allocation that depends on values, so
  `torch.compile(fullgraph=True)` traces it in one graph and CUDA graphs capture it with the block tables as an
  input (graphs.py). B and nb are fixed per bucket.
- `decode(cache, tokens, positions, tables)`: the eager convenience over Python lists (exact batch and width).
- `extend(cache, tables, starts, chunks)`: write the KV of token chunks (prefill / recompute), no logits; one
  vectorised KV write per layer (index tensors built once on the host from the chunk lengths).

Attention (`attention=`, the engine's `decode_attention`): `flex` attends all rows of a decode step in one
FlexAttention call per layer, reading each row's blocks where they lie in the pool (flex.py; the default on CUDA).
`plain`, the reference path that runs everywhere: `decode` on the CPU reads rows whose tables are a few runs of
consecutive blocks in place, as strided views of the pool batched by layout (inplace.py: the gather copy costs more
than the attention there); every other row, and `decode_step` as graphs.py captures it, gathers a row's blocks into
a [B, KV, nb*bs, hd] tensor for torch SDPA. Prefill (`extend`) gathers on both.

Refused at load (`ModelNotFound`, naming the field): a `hidden_act` other than SiLU (the MLP computes
silu(gate) * up) and a RoPE scaling type whose tables depend on the sequence length (`dynamic`, `longrope`, ...):
the engine precomputes one cos/sin table, so only `default`, `linear`, `llama3` and `yarn` are exact.

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

from areal_mq.engines.torch import inplace
from areal_mq.engines.torch.flex import FlexKernels
from areal_mq.engines.torch.kvcache import PagedKVCache, blocks_for
from areal_mq.errors import ModelNotFound

ATTENTIONS = ("plain", "flex")  # decode attention: gather / in-place views (this module), FlexAttention (flex.py)
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
SUPPORTED_HIDDEN_ACTS = ("silu", "swish")  # the MLP computes F.silu(gate) * up
# RoPE types whose cos/sin table does not depend on the sequence length (one table, computed at load, is exact)
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def check_computable(cfg: Any) -> None:
    """Refuse (ModelNotFound, naming the config field) a model this forward pass would compute differently from
    the trainer's HF model: an activation or a RoPE scaling it does not implement."""
    act = getattr(cfg, "hidden_act", "silu")
    if act not in SUPPORTED_HIDDEN_ACTS:
        raise ModelNotFound(f"config field hidden_act={act!r} is not implemented by the torch engine (it computes "
                            f"{' / '.join(SUPPORTED_HIDDEN_ACTS)}); use engine: vllm for this model (docs/engines.md).")
    for field in ("rope_scaling", "rope_parameters"):
        rope = getattr(cfg, field, None)
        if not isinstance(rope, dict):
            continue
        kind = rope.get("rope_type", rope.get("type", "default"))
        if kind not in SUPPORTED_ROPE_TYPES:
            raise ModelNotFound(
                f"config field {field} has rope type {kind!r}, which the torch engine does not implement (its RoPE "
                f"table is computed once; exact for {', '.join(SUPPORTED_ROPE_TYPES)}); use engine: vllm.")


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
    """Runs a loaded HF Llama-family causal LM over a PagedKVCache on the model's device (module docstring)."""

    def __init__(self, model: Any, max_len: int, attention: str = "plain"):
        cfg = model.config
        if cfg.model_type not in SUPPORTED_MODEL_TYPES:
            raise ModelNotFound(
                f"the torch engine supports model types {SUPPORTED_MODEL_TYPES}, got {cfg.model_type!r}; "
                f"use engine: vllm for other architectures (docs/engines.md)."
            )
        check_computable(cfg)
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
        self._gather_buffers: list[torch.Tensor | None] = [None, None]  # CPU: reused K / V gather outputs
        if attention not in ATTENTIONS:
            raise ValueError(f"decode attention {attention!r}: one of {ATTENTIONS}")
        self.attention = attention
        self.flex = FlexKernels() if attention == "flex" else None
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

    def new_cache(self, num_blocks: int, block_size: int = 16) -> PagedKVCache:
        """A pool of `num_blocks` blocks of `block_size` positions (+ the scratch block) on this runner's device."""
        return PagedKVCache(len(self.layers), num_blocks, block_size, self.n_kv, self.head_dim, self.dtype,
                            device=self.device)

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

    def _gather(self, pool: torch.Tensor, index: torch.Tensor, n: int, length: int, which: int) -> torch.Tensor:
        """The keys (which=0) or values (1) of n rows' blocks: pool [KV, blocks, bs, hd] (one layer), index
        [n * KV * nb] (see `_gather_index`) -> contiguous [n, KV, length, hd]: one index_select, a gather of the
        rows' own blocks (block j of a row holds its positions j*bs ... j*bs + bs - 1). Contiguous matters: the
        CPU's SDPA with a mask runs 2x slower on a strided key tensor."""
        flat = pool.view(-1, pool.shape[2], self.head_dim)  # [KV * blocks, bs, hd]
        shape = (n, self.n_kv, length, self.head_dim)
        if flat.device.type != "cpu" or torch.compiler.is_compiling():
            return flat.index_select(0, index).view(shape)
        # CPU eager: into a reused buffer; a fresh one per call costs more in page faults than the copy itself
        need = index.shape[0] * pool.shape[2] * self.head_dim
        buf = self._gather_buffers[which]
        if buf is None or buf.numel() < need or buf.dtype != flat.dtype:
            self._gather_buffers[which] = buf = torch.empty(need, dtype=flat.dtype)
        out = buf[:need].view(index.shape[0], pool.shape[2], self.head_dim)
        return torch.index_select(flat, 0, index, out=out).view(shape)

    def _gather_index(self, tables: torch.Tensor, pool_blocks: int) -> torch.Tensor:
        """Flat (row, head, block) index of block tables [n, nb] into a [KV * pool_blocks, bs, hd] view of one layer."""
        heads = torch.arange(self.n_kv, device=tables.device).view(1, self.n_kv, 1) * pool_blocks
        return (tables.unsqueeze(1) + heads).reshape(-1)

    # -- entry points ----------------------------------------------------------------------------

    def decode_step(self, k_cache: torch.Tensor, v_cache: torch.Tensor, tokens: torch.Tensor,
                    positions: torch.Tensor, tables: torch.Tensor,
                    groups: Sequence[tuple[int, int, int]] | None = None,
                    views: Sequence[tuple[int, Sequence[tuple[int, int, int]], Sequence[int] | None]] = ()
                    ) -> torch.Tensor:
        """The graph-ready decode step (module docstring): float32 logits [B, V]; writes K/V in place.

        tables [B, nb]: row b's block ids (padded with the scratch block); keys attended: nb * block_size.
        groups (host ints, eager only): (start, end, width) row ranges whose keys are read from their first `width`
        blocks only, so short rows beside a long one do not read the long one's width (rows sorted by length).
        views (host ints, eager CPU only): the last rows, in batches (rows, [(first block, step, keys)] per run,
        the last run's keys per row or None) read in place from the pool (inplace.py); groups then cover the rows
        before them.
        Every row's position must be < its width * block_size, its block already in its table (the caller checks
        on the host)."""
        b, nb = tables.shape
        pool_blocks, bs = k_cache.shape[2], k_cache.shape[3]
        cos, sin = self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)  # [B, 1, hd]
        write_block = tables.gather(1, torch.div(positions, bs, rounding_mode="floor").unsqueeze(1)).squeeze(1)
        write_at = write_block * bs + positions % bs  # into a layer's pool seen as [KV, blocks * bs, hd]
        if self.flex is not None and groups is None and not views:
            return self._decode_step_flex(k_cache, v_cache, tokens, positions, tables, cos, sin, write_at)
        sizes = [rows for rows, _, _ in views]
        first_view = b - sum(sizes)
        parts = []  # (start, end, keys, mask [n, 1, 1, keys], gather index)
        for start, end, width in (groups if groups is not None else [(0, b, nb)]):
            length = width * bs
            # key j of row i is visible iff j <= positions[i]
            mask = torch.arange(length, device=tokens.device).unsqueeze(0) <= positions[start:end].unsqueeze(1)
            parts.append((start, end, length, mask.view(end - start, 1, 1, length),
                          self._gather_index(tables[start:end, :width], pool_blocks)))
        in_place = [inplace.batch_views(k_cache, v_cache, spec, rows) for rows, spec, _ in views]
        masks = [None if ragged is None else inplace.last_run_mask(ragged, spec[-1][2], self.dtype, self.device)
                 for _, spec, ragged in views]
        n_groups = self.n_heads // self.n_kv
        x = F.embedding(tokens, self.embed).unsqueeze(1)  # [B, 1, D]
        for li, layer in enumerate(self.layers):
            q, k, v = self._qkv(layer, x, cos, sin)
            # one index_copy_ per pool (an advanced-index assignment costs 3x more); padding rows: the scratch block
            flat = (self.n_kv, pool_blocks * bs, self.head_dim)
            k_cache[li].view(flat).index_copy_(1, write_at, k[:, :, 0].transpose(0, 1))
            v_cache[li].view(flat).index_copy_(1, write_at, v[:, :, 0].transpose(0, 1))
            # a single query per sequence: fold each KV head's query group into the query axis
            qg = q.reshape(b, self.n_kv, n_groups, self.head_dim)
            outs = [F.scaled_dot_product_attention(qg[s:e], self._gather(k_cache[li], index, e - s, length, 0),
                                                   self._gather(v_cache[li], index, e - s, length, 1), attn_mask=mask)
                    for s, e, length, mask, index in parts]
            if views:
                outs += [inplace.attend(qb, batch, li, mask)
                         for qb, batch, mask in zip(qg[first_view:].split(sizes), in_place, masks)]
            out = outs[0] if len(outs) == 1 else torch.cat(outs)
            x = self._finish_layer(layer, x, out.reshape(b, 1, self.n_heads * self.head_dim))
        x = F.rms_norm(x[:, 0], (self.hidden,), self.final_norm, self.eps)
        return F.linear(x, self.lm_head).float()

    def _decode_step_flex(self, k_cache: torch.Tensor, v_cache: torch.Tensor, tokens: torch.Tensor,
                          positions: torch.Tensor, tables: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                          write_at: torch.Tensor) -> torch.Tensor:
        """decode_step with one FlexAttention call per layer for all rows, reading the pool in place (flex.py)."""
        b = tokens.shape[0]
        pool_blocks, bs = k_cache.shape[2], k_cache.shape[3]
        flex = self.flex.for_pool(bs, pool_blocks)
        mask = flex.mask(tables, positions)
        x = F.embedding(tokens, self.embed).unsqueeze(1)  # [B, 1, D]
        flat = (self.n_kv, pool_blocks * bs, self.head_dim)
        for li, layer in enumerate(self.layers):
            q, k, v = self._qkv(layer, x, cos, sin)
            k_cache[li].view(flat).index_copy_(1, write_at, k[:, :, 0].transpose(0, 1))
            v_cache[li].view(flat).index_copy_(1, write_at, v[:, :, 0].transpose(0, 1))
            out = flex.attend(q, k_cache[li], v_cache[li], mask)  # [B, H, 1, hd]
            x = self._finish_layer(layer, x, out.reshape(b, 1, self.n_heads * self.head_dim))
        x = F.rms_norm(x[:, 0], (self.hidden,), self.final_norm, self.eps)
        return F.linear(x, self.lm_head).float()

    @torch.inference_mode()
    def decode(self, cache: PagedKVCache, tokens: Sequence[int], positions: Sequence[int],
               tables: Sequence[Sequence[int]]) -> torch.Tensor:
        """One token per sequence (block tables `tables`) at `positions` (host ints); float32 logits [B, V].

        On the CPU a row whose keys lie in at most inplace.MAX_RUNS runs of consecutive blocks (kvcache.py places
        blocks so that most do) is read in place, in batches of rows laid out alike (inplace.py): no gather copy,
        which costs more than the attention itself there. The other rows are ordered by length and gathered in
        groups of a power-of-two number of blocks each (`decode_step` groups), so a batch of short answers beside
        one long one reads the long width once, not once per row."""
        bs = cache.block_size
        if self.flex is not None:  # one call per layer for all rows, in any order and layout
            width = max(blocks_for(p + 1, bs) for p in positions)
            return self.decode_step(cache.k, cache.v, self.index(tokens), self.index(positions),
                                    self.index_2d(cache.padded_tables(tables, width)))
        cpu = cache.k.device.type == "cpu"
        runs = [inplace.runs_of(tables[i], positions[i] + 1, bs) if cpu else [] for i in range(len(tokens))]
        by_length = sorted(range(len(tokens)), key=lambda i: positions[i])
        batches = inplace.plan([(i, runs[i]) for i in by_length if cpu and len(runs[i]) <= inplace.MAX_RUNS], bs)
        viewed = [i for rows, _, _ in batches for i in rows]
        in_place = set(viewed)
        order = [i for i in by_length if i not in in_place] + viewed
        gathered = len(order) - len(viewed)
        needs = [blocks_for(positions[i] + 1, bs) for i in order[:gathered]]  # ascending
        groups, start = [], 0  # rows whose needs share a power-of-two bucket; width: the group's largest need
        for i in range(1, gathered + 1):
            if i == gathered or (needs[i] - 1).bit_length() != (needs[start] - 1).bit_length():
                groups.append((start, i, needs[i - 1]))
                start = i
        width = max(blocks_for(positions[i] + 1, bs) for i in order)
        logits = self.decode_step(cache.k, cache.v, self.index([tokens[i] for i in order]),
                                  self.index([positions[i] for i in order]),
                                  self.index_2d(cache.padded_tables([tables[i] for i in order], width)), groups,
                                  [(len(rows), spec, ragged) for rows, spec, ragged in batches])
        if order == list(range(len(order))):
            return logits
        inverse = [0] * len(order)
        for at, i in enumerate(order):
            inverse[i] = at
        return logits[self.index(inverse)]

    def index_2d(self, rows: Sequence[Sequence[int]]) -> torch.Tensor:
        """An int64 [N, W] index tensor on the runner's device from equal-length host rows."""
        return torch.tensor(rows, dtype=torch.long, device=self.device)

    @torch.inference_mode()
    def extend(self, cache: PagedKVCache, tables: Sequence[Sequence[int]], starts: Sequence[int],
               chunks: Sequence[Sequence[int]], want_logits: bool = False) -> torch.Tensor | None:
        """Write KV for token `chunks[i]` of the sequence with block table `tables[i]` at positions starts[i]...

        The tables must already hold those positions, in blocks the sequence owns alone (kvcache.py `ensure`,
        `writable`). Chunks are right-padded into one batch. With want_logits, returns float32 logits [N, V] of
        each chunk's last token (used by tests; the engine samples from decode()).
        """
        n, t = len(chunks), max(len(c) for c in chunks)
        lens = [len(c) for c in chunks]
        bs = cache.block_size
        width = blocks_for(max(s + m for s, m in zip(starts, lens)), bs)
        length = width * bs
        padded = [list(c) + [0] * (t - len(c)) for c in chunks]
        tokens = self.index([tok for row in padded for tok in row]).view(n, t)
        pos = (self.index(starts).unsqueeze(1) + torch.arange(t, device=self.device)).clamp(max=self.max_len - 1)
        cos, sin = self.cos[pos], self.sin[pos]
        mask = (torch.arange(length, device=self.device).view(1, 1, length) <= pos.unsqueeze(2)).unsqueeze(1)
        tab = self.index_2d(cache.padded_tables(tables, width))
        # the real (unpadded) tokens, flattened: row i's j-th token goes to position starts[i] + j of its table
        w_row = self.index([i for i, m in enumerate(lens) for _ in range(m)])
        w_t = self.index([j for m in lens for j in range(m)])
        at = [(tables[i][(st + j) // bs], (st + j) % bs) for i, (st, m) in enumerate(zip(starts, lens))
              for j in range(m)]
        w_block, w_off = self.index([b for b, _ in at]), self.index([o for _, o in at])
        x = F.embedding(tokens, self.embed)
        index = self._gather_index(tab, cache.k.shape[2])
        for li, layer in enumerate(self.layers):
            q, k, v = self._qkv(layer, x, cos, sin)
            cache.k[li, :, w_block, w_off] = k[w_row, :, w_t].transpose(0, 1)  # one write per layer, all chunks
            cache.v[li, :, w_block, w_off] = v[w_row, :, w_t].transpose(0, 1)
            keys, values = self._gather(cache.k[li], index, n, length, 0), self._gather(cache.v[li], index, n, length, 1)
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True)
            x = self._finish_layer(layer, x, out.transpose(1, 2).reshape(n, t, -1))
        if not want_logits:
            return None
        last = x[torch.arange(n, device=self.device), self.index(lens) - 1]
        last = F.rms_norm(last, (self.hidden,), self.final_norm, self.eps)
        return F.linear(last, self.lm_head).float()
