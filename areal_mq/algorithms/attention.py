"""trainer.attention varlen: packed micro-batches attend block by block, never through an L x L mask.

What: a packed row is [prompt_a, completions of a..., prompt_b, ...] (shared packing) or [seq_1, seq_2, ...]
(dynamic packing). With trainer.attention sdpa (the default) the row attends through an L x L mask: packing.py
builds a boolean [1, 1, L, L] one for shared packing, transformers builds the block-diagonal one from the position
ids for dynamic packing, and SDPA turns it into an additive bias: 3 bytes a pair in bf16, 3 GiB at L = 32k, and a
mask keeps SDPA off its flash kernels. With varlen the micro-batch carries its blocks instead (`MicroBatch.segments`:
per prompt unit its prompt's columns and its completions' columns, python ints) and this module's attention
function runs one causal SDPA call per completion over [its prompt; itself] (the prompt's rows, computed in the
first completion's call, are its own causal attention): every call is plain causal (`is_causal`, flash kernels
on the CPU and on CUDA), nothing quadratic in the packed row is ever allocated, only in one sequence. A dynamic
row's sequences are units without completions: one causal call each. Padded micro-batches (a [B, L] padding mask)
and the engines are untouched: the function hands them to transformers' own SDPA path.
Equal to the sdpa path to fp32 rounding (the same softmax over the same keys, summed in another order): tests/unit/
algorithms/test_attention_varlen.py, on shared, dynamic and padded packing, tied and untied, with LoRA.
Cost: a prompt's rows are computed once per completion of its unit (its keys are needed by each), so shared
packing does the prompt's attention group_size times instead of once (a prompt is usually short beside its answers);
one Python call per block per layer.
How: `use_varlen(hf_model)` (the trainer does it for the policy and the reference model with trainer.attention
varlen) registers the function and the mask function under ATTN and switches the model to them.
"""
from __future__ import annotations

from typing import Any, Sequence

ATTN = "areal_varlen"  # the name registered in transformers' attention and mask interfaces

# one prompt unit (packing.py builds them): (its prompt's first column, its end, [(start, end) of each completion]);
# a dynamic row's sequence is a unit without completions
Segment = tuple[int, int, list[tuple[int, int]]]


def _mask(*args: Any, **kwargs: Any) -> Any:
    """The mask function: no mask for a packed row (its blocks travel as `areal_segments`); a padded micro-batch's
    [B, L] padding mask made into SDPA's as transformers does."""
    if kwargs.get("attention_mask") is None:
        return None
    from transformers.masking_utils import sdpa_mask

    return sdpa_mask(*args, **kwargs)


def varlen_attention(module: Any, query: Any, key: Any, value: Any, attention_mask: Any, dropout: float = 0.0,
                     scaling: float | None = None, is_causal: bool | None = None,
                     areal_segments: Sequence[Segment] | None = None, **kwargs: Any) -> tuple[Any, None]:
    """transformers' attention-function signature: query [1, H, L, D], key/value [1, H_kv, L, D]; returns
    ([1, L, H, D], None). Without `areal_segments` (a padded micro-batch) transformers' SDPA function."""
    import torch
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    if areal_segments is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    if query.shape[0] != 1:
        raise ValueError(f"varlen attention takes one packed row, got a batch of {query.shape[0]}")
    gqa = key.shape[1] != query.shape[1]
    drop = dropout if module.training else 0.0
    pieces = []
    for p0, p1, completions in areal_segments:
        if not completions:  # a dynamic row's sequence, or a prompt alone: causal over itself
            pieces.append(sdpa(query[:, :, p0:p1], key[:, :, p0:p1], value[:, :, p0:p1], dropout_p=drop,
                               is_causal=True, scale=scaling, enable_gqa=gqa))
            continue
        n_prompt = p1 - p0
        for k, (c0, c1) in enumerate(completions):
            q = torch.cat([query[:, :, p0:p1], query[:, :, c0:c1]], dim=2)
            kk = torch.cat([key[:, :, p0:p1], key[:, :, c0:c1]], dim=2)
            vv = torch.cat([value[:, :, p0:p1], value[:, :, c0:c1]], dim=2)
            out = sdpa(q, kk, vv, dropout_p=drop, is_causal=True, scale=scaling, enable_gqa=gqa)
            if k == 0:
                pieces.append(out[:, :, :n_prompt])  # the prompt's own causal attention
            pieces.append(out[:, :, n_prompt:])
    out = torch.cat(pieces, dim=2)
    if out.shape[2] != query.shape[2]:
        raise ValueError(f"areal_segments cover {out.shape[2]} of the row's {query.shape[2]} columns")
    return out.transpose(1, 2).contiguous(), None


def register() -> None:
    """Register ATTN in transformers' attention and mask interfaces (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTN, varlen_attention)
    AttentionMaskInterface.register(ATTN, _mask)


def use_varlen(model: Any) -> Any:
    """Switch a Hugging Face model (or a PEFT model around one) to ATTN; returns it."""
    register()
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    base.set_attn_implementation(ATTN)
    return model
