"""The rows an engine can run: the one admission rule the torch engine acts on, `plan` reports and the rehearsal carries.

What (issue 59): a waiting request is admitted, first come first served, while
  1. a slot is free (`rollout.engine.max_concurrent`);
  2. the KV pool, less a 1 % watermark and the blocks promised to rows still prefilling, holds its prompt;
  3. only where the user set `rollout.engine.max_reserved_tokens`: the running rows' reservations (prompt +
     max_new_tokens each) stay under it.
Rows then take blocks as they produce tokens; when the pool runs out the youngest row is preempted and recomputed
later (engines/torch/engine.py). So the pool, not the longest answer a row might write, decides how many run.

Why one module: the engine used to cap the rows' reservations at max_kv_tokens (65,536 by default) while `plan` read
max_concurrent alone: a node layout sized for 256 rows of 8k answers on a 40 GiB pool ran 7 and was planned at 100 %.
Now `steady_rows` (what plan and the rehearsal report) and `admits` (what the engine asks per request) read the same
fields with the same arithmetic, so the three cannot disagree.

Steady state (`steady_rows`): a row holds its prompt plus what it has generated so far. Answers drawn from a stated
length distribution (`AnswerLengths`; default uniform over [0, max_new_tokens], a conservative stand-in where the data
has not been measured) leave the rows seen at a random moment length-biased: a row holds on average
prompt + E[L^2] / (2 E[L]) tokens, plus half a block of rounding. The pool holds usable_tokens / that many rows.
"""
from __future__ import annotations

from dataclasses import dataclass


def watermark_blocks(num_blocks: int) -> int:
    """Blocks admission leaves free (1 %, at least one): a step's new tokens find a block without a preemption."""
    return max(1, num_blocks // 100)


def reservation_allows(cap: int | None, reserved: int, need: int) -> bool:
    """Rule 3: with no cap set (the default) reservations never hold a request back."""
    return cap is None or reserved + need <= cap


def admits(*, running: int, max_concurrent: int, room_blocks: int, need_blocks: int, cap: int | None, reserved: int,
           need_reserved: int) -> bool:
    """Whether the head of the queue is admitted now (rules 1-3). `room_blocks`: free blocks less the watermark and
    the blocks promised to prefilling rows; an idle engine always takes its head (its prompt was checked to fit the
    pool when it was submitted)."""
    if running >= max_concurrent or not reservation_allows(cap, reserved, need_reserved):
        return False
    return need_blocks <= room_blocks or running == 0


@dataclass(frozen=True)
class AnswerLengths:
    """A stated distribution of answer lengths, as moments in tokens: `mean` E[L] and `mean_sq` E[L^2]."""
    mean: float
    mean_sq: float
    source: str

    @classmethod
    def uniform(cls, max_new_tokens: int) -> "AnswerLengths":
        m = float(max_new_tokens)
        return cls(m / 2, m * m / 3, f"uniform over [0, {max_new_tokens}] tokens (stated, not measured)")

    @classmethod
    def measured(cls, lengths: list[int], source: str) -> "AnswerLengths":
        n = max(1, len(lengths))
        return cls(sum(lengths) / n, sum(x * x for x in lengths) / n, source)

    def live_tokens(self) -> float:
        """Generated tokens a row holds at a random moment (length-biased: long answers are seen longer)."""
        return self.mean_sq / (2 * self.mean) if self.mean > 0 else 0.0


def steady_rows(*, max_concurrent: int, pool_tokens: int, block_size: int, prompt_tokens: int, max_new_tokens: int,
                cap: int | None = None, lengths: AnswerLengths | None = None) -> dict:
    """Rows running per engine in steady state under the rule above, what limits them, and the pool's use."""
    lengths = lengths or AnswerLengths.uniform(max_new_tokens)
    num_blocks = pool_tokens // block_size
    usable = (num_blocks - watermark_blocks(num_blocks)) * block_size
    per_row = prompt_tokens + lengths.live_tokens() + block_size / 2
    limits = {"rollout.engine.max_concurrent": max_concurrent, "the KV pool": int(usable // per_row)}
    if cap is not None:
        limits["rollout.engine.max_reserved_tokens"] = cap // (prompt_tokens + max_new_tokens)
    limited_by = min(limits, key=lambda k: limits[k])
    rows = max(0, limits[limited_by])
    return {"rows": rows, "max_concurrent": max_concurrent, "running": round(rows / max_concurrent, 4),
            "limited_by": limited_by, "limits": limits, "pool_tokens": pool_tokens,
            "kv_use": round(min(1.0, rows * per_row / max(1, pool_tokens)), 4),
            "row_tokens": round(per_row, 1), "lengths": lengths.source}
