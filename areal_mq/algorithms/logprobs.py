"""Logprobs (and entropies) of chosen tokens from the last hidden states, without a [tokens, vocabulary] fp32
logits tensor.

What: `chunked_logprobs(hidden, weight, targets, temperature, chunk_tokens)` computes, per token i,
`log_softmax(lm_head(hidden[i]).float() / temperature)[targets[i]]` — what `token_logprobs` did from the
model's full logits — `chunk_tokens` rows at a time. `lm_head_of(model)` finds the LM head of a Hugging Face
causal LM; `chunk_tokens_for(vocab_size, budget_mib)` sizes the chunks from the vocabulary; `full_logprobs` is the
full-logits reference the tests and benchmarks compare with.
Why: at a 151,936-token vocabulary (Qwen2.5) the full fp32 logits of 8,192 tokens take 5 GB, and autograd keeps
them (and their log-softmax) alive until backward. Here a custom autograd Function keeps only the per-token
logsumexp [N] and recomputes each chunk's logits in backward, where d logp / d logits = onehot - softmax: at
most one chunk's [chunk, V] fp32 logits (and their softmax / gradient) is alive at a time, forward or backward.
Measured (live tensor bytes, forward + backward with entropy, 2,048 tokens at V = 151,936, 256 MiB chunks):
4.6 GiB full, 1.0 GiB with torch.utils.checkpoint per chunk (it keeps each chunk's logits during its
recompute and their gradient beside them), 0.5 GiB with this Function.
The entropies are without gradient unless asked (`entropy_grad`, for trainer.entropy_coef): then backward adds
dH/dz = -softmax * (log softmax + H) to each chunk's logit gradient, one more [chunk, V] fp32 tensor while it runs.
The matmul follows autocast like the model's own lm_head would (bf16 under a bf16 autocast), the softmax is fp32.
How to run its tests and benchmark:
    python -m pytest tests/unit/algorithms/test_logprobs_chunked.py
    python benchmarks/speed/logprobs.py --quick
"""
from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import torch
import torch.nn.functional as F

# Families whose causal-LM forward computes exactly `logits = lm_head(hidden_states)` (checked against
# transformers' modeling_<family>.py); lm_head_of refuses others rather than compute different logprobs.
PLAIN_HEAD_FAMILIES = frozenset({
    "llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "gemma", "phi3", "olmo2", "smollm3",
})
# Config attributes of families that transform the head's output (Gemma2/3 tanh softcap, Cohere x scale,
# Granite / scale): named in the error so the reader knows what is missing.
LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling")


def chunk_tokens_for(vocab_size: int, budget_mib: float = 256.0) -> int:
    """Tokens per chunk so that one chunk's fp32 logits [chunk, vocab_size] fit in `budget_mib` MiB: size is data.

    chunk = budget_bytes // (4 * vocab_size), at least 1. E.g. 256 MiB at Qwen2.5's 151,936 tokens -> 441 tokens;
    at a 49,152 vocabulary (SmolLM2) -> 1,365. The peak beside the model is about twice the budget (the logits
    and their softmax or gradient, plus a bf16 copy under autocast), plus the head's weight in the matmul dtype
    and its fp32 [V, H] gradient accumulator (and, under autocast, one bf16 [V, H] product per chunk).
    """
    return max(1, int(budget_mib * 2**20) // (4 * int(vocab_size)))


def lm_head_of(model: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(weight [V, H], bias [V] or None) of a Hugging Face causal LM's output embedding (`lm_head`, possibly tied
    to the input embeddings). Raises NotImplementedError for a family whose logits are not exactly
    `lm_head(hidden)` (final logit softcapping, logit scaling) or that is not known to be plain."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    for name in LOGIT_TRANSFORMS:
        if getattr(config, name, None) is not None:
            raise NotImplementedError(
                f"chunked logprobs: model family {config.model_type!r} transforms its logits after the LM head "
                f"(config.{name}={getattr(config, name)!r}); chunked_logprobs computes plain lm_head(hidden) "
                f"logits only. Use the full-logits path for this model, or add the transform to logprobs.py.")
    if config.model_type not in PLAIN_HEAD_FAMILIES:
        raise NotImplementedError(
            f"chunked logprobs: model family {config.model_type!r} is not known to compute logits as plain "
            f"lm_head(hidden). Check its ForCausalLM.forward in transformers and, if it does, add it to "
            f"PLAIN_HEAD_FAMILIES in areal_mq/algorithms/logprobs.py.")
    head = model.get_output_embeddings()
    return head.weight, getattr(head, "bias", None)


def chunked_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float,
                     chunk_tokens: int, with_entropy: bool = False, bias: torch.Tensor | None = None,
                     entropy_grad: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(logp [N] fp32, entropy [N] fp32 or None) of `targets` [N] under the logits
    `(hidden [N, H] @ weight[V, H].T + bias).float() / temperature` (no division when temperature <= 0 or == 1),
    `chunk_tokens` rows at a time. Differentiable wrt hidden, weight and bias; the entropy only with
    `entropy_grad` (which implies with_entropy)."""
    with_entropy = with_entropy or entropy_grad
    device_type = hidden.device.type
    autocast = torch.amp.is_autocast_available(device_type) and torch.is_autocast_enabled(device_type)
    dtype = torch.get_autocast_dtype(device_type) if autocast else torch.promote_types(hidden.dtype, weight.dtype)
    divisor = float(temperature) if temperature > 0 and temperature != 1.0 else 1.0
    logp, entropy = _ChunkedLogprobs.apply(hidden, weight, bias, targets.long(), divisor, max(1, int(chunk_tokens)),
                                           with_entropy, dtype, entropy_grad)
    return logp, (entropy if with_entropy else None)


def full_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float,
                  with_entropy: bool = False, bias: torch.Tensor | None = None, entropy_grad: bool = False,
                  ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The reference chunked_logprobs must equal: the same result from the whole fp32 [N, V] logits at once (what
    trainer.token_logprobs computed from the model's logits). For tests and benchmarks."""
    logits = F.linear(hidden, weight, bias).float()
    if temperature > 0 and temperature != 1.0:
        logits = logits / temperature
    logp_all = torch.log_softmax(logits, dim=-1)
    logp = logp_all.gather(-1, targets.long()[:, None]).squeeze(-1)
    entropy = None
    if with_entropy or entropy_grad:
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy


def _no_autocast(device_type: str):
    """Autocast off (casts are explicit here); a no-op context on devices without autocast (meta)."""
    return torch.autocast(device_type, enabled=False) if torch.amp.is_autocast_available(device_type) else nullcontext()


def _chunk_logits(h: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, divisor: float) -> torch.Tensor:
    """fp32 logits [c, V] of one chunk; h, w, b already in the matmul dtype."""
    z = F.linear(h, w, b).float()
    return z.div_(divisor) if divisor != 1.0 else z


class _ChunkedLogprobs(torch.autograd.Function):
    """Saves hidden, weight, bias, targets and the logsumexp [N] (and the entropy [N] when it is differentiable);
    recomputes each chunk's logits in backward."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, divisor, chunk, with_entropy, dtype, entropy_grad=False):
        n = hidden.shape[0]
        logp = torch.empty(n, dtype=torch.float32, device=hidden.device)
        lse = torch.empty_like(logp)
        entropy = torch.empty_like(logp) if with_entropy else torch.empty(0, device=hidden.device)
        with _no_autocast(hidden.device.type):
            w, b = weight.to(dtype), None if bias is None else bias.to(dtype)
            for s in range(0, n, chunk):
                z = _chunk_logits(hidden[s:s + chunk].to(dtype), w, b, divisor)
                lse[s:s + chunk] = torch.logsumexp(z, -1)
                logp[s:s + chunk] = z.gather(-1, targets[s:s + chunk, None]).squeeze(-1) - lse[s:s + chunk]
                if with_entropy:  # -sum p log p, with log p = z - lse computed in place
                    logp_all = z.sub_(lse[s:s + chunk, None])
                    entropy[s:s + chunk] = -logp_all.exp().mul_(logp_all).sum(-1)
                del z
        ctx.save_for_backward(hidden, weight, bias, targets, lse, entropy if entropy_grad else None)
        ctx.divisor, ctx.chunk, ctx.dtype = divisor, chunk, dtype
        if not entropy_grad:
            ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        hidden, weight, bias, targets, lse, entropy = ctx.saved_tensors
        if entropy is None:
            grad_entropy = None
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        dtype, chunk, n = ctx.dtype, ctx.chunk, hidden.shape[0]
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        grad_b = torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device) if need_b else None
        with _no_autocast(hidden.device.type):
            w, b = weight.to(dtype), None if bias is None else bias.to(dtype)
            for s in range(0, n, chunk):
                h = hidden[s:s + chunk].to(dtype)
                g = grad_logp[s:s + chunk, None].float() / ctx.divisor  # the 1/T of logits / T, on [c] not [c, V]
                if grad_entropy is None:
                    p = _chunk_logits(h, w, b, ctx.divisor).sub_(lse[s:s + chunk, None]).exp_()  # softmax
                    dz = p.mul_(-g).scatter_add_(-1, targets[s:s + chunk, None], g).to(dtype)  # g (onehot - p) / T
                else:  # + ge dH/dz = -ge p (log p + H) / T: dz = g onehot - p (g + ge (log p + H)) / T
                    ge = grad_entropy[s:s + chunk, None].float() / ctx.divisor
                    log_p = _chunk_logits(h, w, b, ctx.divisor).sub_(lse[s:s + chunk, None])
                    p = log_p.exp()
                    coef = log_p.add_(entropy[s:s + chunk, None]).mul_(ge).add_(g)
                    dz = p.mul_(coef).neg_().scatter_add_(-1, targets[s:s + chunk, None], g).to(dtype)
                    del log_p, coef
                if need_h:
                    grad_h[s:s + chunk] = dz @ w
                if need_w:
                    if dtype == torch.float32:
                        grad_w.addmm_(dz.T, h)
                    else:
                        grad_w += dz.T @ h
                if need_b:
                    grad_b += dz.sum(0, dtype=torch.float32)
                del p, dz
        grad_w = grad_w.to(weight.dtype) if need_w else None
        grad_b = grad_b.to(bias.dtype) if need_b else None
        return grad_h, grad_w, grad_b, None, None, None, None, None, None
