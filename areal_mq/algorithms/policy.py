"""The policy as the trainer calls it: a Hugging Face causal LM whose forward returns the chosen tokens' logprobs.

What: `PolicyLogprobs(lm, chunk_mb)(...)` runs the decoder (`lm.model`), keeps the hidden states of the positions
that predict generated tokens, and computes their logprobs (and entropies) with the LM head in chunks of tokens
(areal_mq/algorithms/logprobs.py), so no [tokens, vocabulary] fp32 logits tensor is ever alive whole.
Why a module and not a function: under FSDP2 the head is used here as a weight (chunked, never `head(...)`), so
it must be gathered while this module's forward runs: a tied head by the root's forward hook (this module is the
root), an untied one by its norm + head unit's hook on the final norm, completed only at the root's end
(algorithms/fsdp.py shard_policy); DDP likewise wraps one module. The Hugging Face model stays reachable as `.lm` (the
trainer's `unwrapped`) for its config, state dict and `save_pretrained`.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn


class PolicyLogprobs(nn.Module):
    """`forward(...) -> (logp [N] fp32, entropy [N] fp32 | None)` over the generated tokens of one micro-batch
    (the entropy differentiable with `entropy_grad`)."""

    def __init__(self, lm: nn.Module, chunk_mb: float = 256.0, autocast: torch.dtype | None = None):
        super().__init__()
        self.lm = lm
        self.chunk_mb = chunk_mb
        self.autocast = autocast  # trainer.precision fp16 under ddp: the forward runs under fp16 autocast

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                keep_cols: torch.Tensor, logit_index: torch.Tensor, targets: torch.Tensor, temperature: float,
                with_entropy: bool = False, entropy_grad: bool = False,
                segments: list | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`segments`: a packed row's blocks under trainer.attention varlen (algorithms/attention.py), else None."""
        if self.autocast is not None:
            with torch.autocast(input_ids.device.type, dtype=self.autocast):
                return self._forward(input_ids, position_ids, attention_mask, keep_cols, logit_index, targets,
                                     temperature, with_entropy, entropy_grad, segments)
        return self._forward(input_ids, position_ids, attention_mask, keep_cols, logit_index, targets, temperature,
                             with_entropy, entropy_grad, segments)

    def _forward(self, input_ids, position_ids, attention_mask, keep_cols, logit_index, targets, temperature,
                 with_entropy, entropy_grad=False, segments=None):
        from areal_mq.algorithms.logprobs import chunk_tokens_for, chunked_logprobs, lm_head_of

        extra = {} if segments is None else {"areal_segments": segments}  # reaches every layer's attention call
        hidden = self.lm.model(input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask,
                               use_cache=False, **extra).last_hidden_state  # use_cache=False: else the packed mask is skipped
        hidden = hidden[:, keep_cols].reshape(-1, hidden.shape[-1])[logit_index]
        weight, bias = lm_head_of(self.lm)
        chunk = chunk_tokens_for(weight.shape[0], self.chunk_mb)
        return chunked_logprobs(hidden, weight, targets, temperature, chunk, with_entropy=with_entropy, bias=bias,
                                entropy_grad=entropy_grad)


def as_policy(model: Any, chunk_mb: float = 256.0) -> Any:
    """`model` when it is (or wraps, as DDP's `.module`) a PolicyLogprobs, else a PolicyLogprobs around it."""
    inner = getattr(model, "module", model)
    return model if isinstance(inner, PolicyLogprobs) else PolicyLogprobs(model, chunk_mb)
