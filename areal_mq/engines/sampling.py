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

Device: everything runs on the device of `logits`; each generator must be on that device too (the torch
engine makes them there). Which rows are greedy, sampled or truncated is decided on the host from the
Python parameters (rounded to float32 first, as the math sees them), so sampling never waits for the device:
the caller reads the tokens back once.
"""
from __future__ import annotations

from typing import Sequence

import torch


def _truncate(weights: torch.Tensor, top_ps: torch.Tensor, top_ks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Sort unnormalized weights [N, V] descending and zero what top-k / top-p exclude;
    returns (kept weights in sorted order, order)."""
    sorted_w, order = weights.sort(dim=-1, descending=True)
    rank = torch.arange(weights.shape[-1], device=weights.device).unsqueeze(0)
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


def _rows(picked: list[int], total: int, device: torch.device) -> slice | torch.Tensor:
    """Index for rows `picked` of `total`: a slice when it is all of them (a view, no [N, V] copy)."""
    return slice(None) if len(picked) == total else torch.tensor(picked, dtype=torch.long, device=device)


def sample_tokens(
    logits: torch.Tensor,
    temperatures: Sequence[float],
    top_ps: Sequence[float],
    top_ks: Sequence[int],
    generators: Sequence[torch.Generator | None],
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [N, V] float32 -> (tokens [N] int64, behaviour logprobs [N] float32), on logits' device."""
    n, device = logits.shape[0], logits.device
    temps = torch.tensor(list(temperatures), dtype=torch.float32)  # host: decisions below need no sync
    host_temps = temps.tolist()
    greedy = [i for i, t in enumerate(host_temps) if t <= 0.0]
    sampled = [i for i, t in enumerate(host_temps) if t > 0.0]
    scale = torch.where(temps <= 0.0, torch.ones_like(temps), temps).to(device)
    shifted = logits / scale.unsqueeze(1)
    shifted -= shifted.amax(dim=-1, keepdim=True)  # softmax weights exp(shifted) <= 1, no overflow
    weights = shifted.exp()
    log_total = weights.sum(dim=-1).log()  # so log_softmax(x)[t] = shifted[t] - log_total
    tokens = torch.empty(n, dtype=torch.long, device=device)
    if greedy:
        rows = _rows(greedy, n, device)
        tokens[rows] = logits[rows].argmax(dim=-1)
    if sampled:
        bad = [i for i in sampled if generators[i] is not None and generators[i].device != device]
        if bad:
            raise ValueError(f"row {bad[0]}'s generator is on {generators[bad[0]].device}, the logits on {device}; "
                             f"make each request's torch.Generator on the logits' device")
        u = torch.stack([torch.rand((), generator=generators[i], device=device) for i in sampled])
        host_tp = torch.tensor([float(top_ps[i]) for i in sampled], dtype=torch.float32)
        tk_list = [int(top_ks[i]) for i in sampled]
        tp, tk = host_tp.to(device), torch.tensor(tk_list, dtype=torch.long, device=device)
        rows = _rows(sampled, n, device)
        w = weights[rows]
        truncating = [j for j, (p, k) in enumerate(zip(host_tp.tolist(), tk_list)) if p < 1.0 or k > 0]
        plain = sorted(set(range(len(sampled))) - set(truncating))
        picked = torch.empty(len(sampled), dtype=torch.long, device=device)
        if truncating:
            sel = _rows(truncating, len(sampled), device)
            kept, order = _truncate(w[sel], tp[sel], tk[sel])
            picked[sel] = order.gather(1, _inverse_cdf(kept, u[sel]).unsqueeze(1)).squeeze(1)
        if plain:
            sel = _rows(plain, len(sampled), device)
            picked[sel] = _inverse_cdf(w[sel], u[sel])
        tokens[rows] = picked
    return tokens, shifted.gather(1, tokens.unsqueeze(1)).squeeze(1) - log_total


def sample_tensors(logits: torch.Tensor, temperatures: torch.Tensor, top_ps: torch.Tensor, top_ks: torch.Tensor,
                   uniforms: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`sample_tokens` as a pure tensor function (what a captured CUDA graph of the whole decode step runs,
    graphs.py): temperatures / top_ps [N] float32, top_ks [N] int64, uniforms [N] float32 (row i's draw from its
    generator; ignored for greedy rows) -> (tokens [N] int64, logprobs [N] float32), the same values
    `sample_tokens` gives with those draws. Every branch is computed for every row and selected per row, so
    nothing depends on host values; the sort of the truncation runs every step (its cost is what buys no sync)."""
    greedy = temperatures <= 0.0
    scale = torch.where(greedy, torch.ones_like(temperatures), temperatures)
    shifted = logits / scale.unsqueeze(1)
    shifted -= shifted.amax(dim=-1, keepdim=True)
    weights = shifted.exp()
    log_total = weights.sum(dim=-1).log()
    plain = _inverse_cdf(weights, uniforms)
    kept, order = _truncate(weights, top_ps, top_ks)
    truncated = order.gather(1, _inverse_cdf(kept, uniforms).unsqueeze(1)).squeeze(1)
    truncating = (top_ps < 1.0) | (top_ks > 0)
    tokens = torch.where(greedy, logits.argmax(dim=-1), torch.where(truncating, truncated, plain))
    return tokens, shifted.gather(1, tokens.unsqueeze(1)).squeeze(1) - log_total
