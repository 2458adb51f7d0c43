"""What `kv_on_update: keep` leaves behind, measured: the logprob gap between old and recomputed KV.

What: `kv_logprob_gap(runner, cache, rows, n)`, called by the engine right after new weights are in place and
before in-flight KV is kept or dropped: for up to n ready rows it computes the next-token distribution twice under
the new weights, once over the row's existing KV (written by the old weights: what `keep` decodes from) and once
over KV recomputed from the row's tokens in fresh blocks (what `recompute` decodes from), and returns the mean
and max over rows of |logprob_keep - logprob_recompute| of the recomputed argmax token and of KL(recompute ||
keep). Costs one prefill of each sampled row: `kv_gap_rows` (engine config) sizes it; 0 (default) skips it.

Why: the default update choice should be made by evidence (issue 42): `keep` costs no stall and its tokens are
corrected by decoupled PPO as long as the gap it leaves is small; `recompute` stalls for every in-flight token.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch


@torch.inference_mode()
def kv_logprob_gap(runner: Any, cache: Any, rows: Sequence[Any], n: int) -> dict[str, float]:
    """{"gap_rows", "gap_logprob_mean", "gap_logprob_max", "gap_kl_mean"} over up to n ready rows (module docstring)."""
    sample = [s for s in rows if s.ready and s.table and len(s.tokens) - 1 < len(s.table) * cache.block_size][:n]
    keep_lp, fresh_lp = [], []
    for seq in sample:
        table: list[int] = []
        if not cache.ensure(table, len(seq.tokens)):
            break  # no room for a recomputed copy: measure fewer rows
        try:
            fresh = runner.extend(cache, [table], [0], [seq.tokens], want_logits=True)
        finally:
            cache.release(table)
        # decode writes the last token's K/V at its position: a keep decode rewrites the same values next step,
        # a recompute drops the blocks
        kept = runner.decode(cache, [seq.tokens[-1]], [len(seq.tokens) - 1], [seq.table])
        keep_lp.append(torch.log_softmax(kept[0].float(), -1))
        fresh_lp.append(torch.log_softmax(fresh[0].float(), -1))
    if not keep_lp:
        return {"gap_rows": 0.0}
    keep, fresh = torch.stack(keep_lp), torch.stack(fresh_lp)
    top = fresh.argmax(-1, keepdim=True)
    gap = (keep.gather(1, top) - fresh.gather(1, top)).abs().squeeze(1)
    kl = (fresh.exp() * (fresh - keep)).sum(-1)
    return {"gap_rows": float(len(keep_lp)), "gap_logprob_mean": float(gap.mean()),
            "gap_logprob_max": float(gap.max()), "gap_kl_mean": float(kl.mean())}
