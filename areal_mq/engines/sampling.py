"""Batched token sampling with per-request random streams, and behaviour logprobs.

What: `sample_tokens(logits, temperatures, top_ps, top_ks, generators)` picks one token per row and
returns (tokens, logprobs).

- temperature 0 -> greedy (argmax); logprob = log_softmax(logits)[token].
- otherwise the logprob is log_softmax(logits / temperature)[token], computed BEFORE top-p/top-k
  truncation (the convention in areal_mq/engines/base.py shared with the trainer); the token is
  drawn from the truncated, renormalized distribution.
- Each row draws exactly one uniform number per token from its own torch.Generator and samples by
  inverse CDF, so a request's tokens depend on its seed and its logits only, never on which other
  requests share the batch (up to float rounding differences in the logits themselves).

Why vectorized: with a 49k vocabulary a per-row softmax/sort loop costs milliseconds per row; here
the softmax, truncation and inverse-CDF search run once over the whole batch.
"""
from __future__ import annotations

from typing import Sequence

import torch


def _truncate(weights: torch.Tensor, top_ps: torch.Tensor, top_ks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Sort unnormalized weights [N, V] descending and zero what top-k / top-p exclude;
    returns (kept weights in sorted order, order)."""
    sorted_w, order = weights.sort(dim=-1, descending=True)
    rank = torch.arange(weights.shape[-1]).unsqueeze(0)
    cum = sorted_w.cumsum(-1)
    before = cum - sorted_w  # mass strictly before each token
    keep = before < top_ps.unsqueeze(1) * cum[:, -1:]  # smallest prefix reaching top_p (first always kept)
    keep &= (top_ks.unsqueeze(1) <= 0) | (rank < top_ks.unsqueeze(1))
    return sorted_w * keep, order


def _inverse_cdf(weights: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Index i of each row with cdf[i-1] <= u * total < cdf[i]; zero-weight entries are never picked."""
    cdf = weights.cumsum(-1)
    target = (uniforms * cdf[:, -1]).unsqueeze(1)
    idx = torch.searchsorted(cdf, target, right=True).squeeze(1)
    return idx.clamp(max=weights.shape[-1] - 1)


def _rows(mask: torch.Tensor) -> slice | torch.Tensor:
    """Index for the rows in `mask`: a slice when it is all of them (a view, no [N, V] copy)."""
    return slice(None) if bool(mask.all()) else mask.nonzero().flatten()


def sample_tokens(
    logits: torch.Tensor,
    temperatures: Sequence[float],
    top_ps: Sequence[float],
    top_ks: Sequence[int],
    generators: Sequence[torch.Generator | None],
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [N, V] float32 -> (tokens [N] int64, behaviour logprobs [N] float32)."""
    n = logits.shape[0]
    temps = torch.tensor(list(temperatures), dtype=torch.float32)
    greedy = temps <= 0.0
    shifted = logits / torch.where(greedy, torch.ones_like(temps), temps).unsqueeze(1)
    shifted -= shifted.amax(dim=-1, keepdim=True)  # softmax weights exp(shifted) <= 1, no overflow
    weights = shifted.exp()
    log_total = weights.sum(dim=-1).log()  # so log_softmax(x)[t] = shifted[t] - log_total
    tokens = torch.empty(n, dtype=torch.long)
    if bool(greedy.any()):
        tokens[greedy] = logits[greedy].argmax(dim=-1)
    sampled = (~greedy).nonzero().flatten().tolist()
    if sampled:
        u = torch.stack([torch.rand((), generator=generators[i]) for i in sampled])
        tp = torch.tensor([float(top_ps[i]) for i in sampled])
        tk = torch.tensor([int(top_ks[i]) for i in sampled])
        w = weights if len(sampled) == n else weights[sampled]
        truncating = (tp < 1.0) | (tk > 0)
        picked = torch.empty(len(sampled), dtype=torch.long)
        if bool(truncating.any()):
            rows = _rows(truncating)
            kept, order = _truncate(w[rows], tp[rows], tk[rows])
            picked[rows] = order.gather(1, _inverse_cdf(kept, u[rows]).unsqueeze(1)).squeeze(1)
        if not bool(truncating.all()):
            rows = _rows(~truncating)
            picked[rows] = _inverse_cdf(w[rows], u[rows])
        tokens[sampled] = picked
    return tokens, shifted.gather(1, tokens.unsqueeze(1)).squeeze(1) - log_total
