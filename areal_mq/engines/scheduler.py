"""The torch engine's scheduler with no tensors: admission, chunked prefill, decode rows and preemption.

What: `Scheduler` owns the waiting queue and the running rows of one engine and decides, every step, on the block
pool's bookkeeping alone (engines/blocks.py):
    admit      FIFO by the one admission rule (engines/admission.py `admits`): a free slot, the pool less a 1 %
               watermark and the blocks promised to rows still prefilling holds the prompt (once per distinct token
               list: the samples of one prompt share their prefill blocks), and max_reserved_tokens only where set;
               the head waits for room rather than being overtaken
    prefill    which rows compute which chunk of pending tokens this step (`plan_prefill`, at most
               prefill_chunk_tokens, or recompute_chunk_tokens while rows rebuild KV after a weight update), which
               rows share a chunk another row computes from an identical KV history (`share_prefill`), and, once
               the engine computed the chunks, the bookkeeping (`commit_prefill`)
    decode     the ready rows, oldest first, each with its own block for the positions it writes (`decode_rows`)
    preempt    when a row needs a block and the pool is empty, the youngest row (latest submitted) frees its blocks
               and waits at the head of the queue, to be recomputed from its tokens later
A row only has to look like engines/torch/seq.py `SeqState` where the scheduler reads it: `tokens`, `reserved`,
`order`, `table`, `kv_len`, `kv_sig`, `ready`, `advance_kv`, `reset_kv`.

Why pure: the engine (engines/torch/engine.py) drives it around its tensor work (the forward passes, sampling), and
the scheduler twin (engines/twin.py) drives the same object in virtual time at a config's full numbers (hundreds of
rows, a pool of millions of tokens), so what `areal-mq plan` prints as rows running and preemptions is what this
code does, not a formula beside it. `trace` (a list, when set) records every decision as (step, event, row order):
tests/unit/engines/test_twin.py holds the twin's decisions equal to the engine's, step by step.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

from areal_mq.engines.admission import admits, watermark_blocks
from areal_mq.engines.blocks import BlockPool, blocks_for


@dataclass
class PrefillPlan:
    """One step's prefill: `picked` rows compute `chunks` starting at `starts`; `followers` (row, index into chunks)
    take the blocks of the row that computes the same chunk."""
    picked: list[Any] = field(default_factory=list)
    starts: list[int] = field(default_factory=list)
    chunks: list[list[int]] = field(default_factory=list)
    followers: list[tuple[Any, int]] = field(default_factory=list)


class Scheduler:
    """Waiting queue, running rows and their blocks (module docstring)."""

    def __init__(self, pool: BlockPool, *, max_concurrent: int, prefill_chunk_tokens: int,
                 recompute_chunk_tokens: int = 0, share_prefill: bool = True, max_reserved_tokens: int | None = None):
        self.pool = pool
        self.max_concurrent = max_concurrent
        self.prefill_chunk_tokens = prefill_chunk_tokens
        self.recompute_chunk_tokens = recompute_chunk_tokens
        self.share_prefill = share_prefill
        self.cap = max_reserved_tokens
        self.waiting: deque[Any] = deque()
        self.rows: list[Any] = []
        self.recomputing: set[int] = set()  # ids of rows rebuilding KV after a weight update
        self.preempted = 0
        self.preempted_tokens = 0
        self.steps = 0  # `tick` counts them; trace entries carry it
        self.trace: list[tuple[int, str, int]] | None = None

    @classmethod
    def for_config(cls, pool: BlockPool, cfg: Any) -> "Scheduler":
        """A scheduler with an EngineConfig's knobs (engines/config.py)."""
        sched = cls(pool, max_concurrent=cfg.max_concurrent, prefill_chunk_tokens=cfg.prefill_chunk_tokens)
        sched.configure(cfg)
        return sched

    def configure(self, cfg: Any) -> None:
        """Take an EngineConfig's scheduling knobs (the engine calls it again when its config is replaced)."""
        self.max_concurrent, self.prefill_chunk_tokens = cfg.max_concurrent, cfg.prefill_chunk_tokens
        self.recompute_chunk_tokens, self.share_prefill = cfg.recompute_chunk_tokens, cfg.share_prefill
        self.cap = cfg.max_reserved_tokens

    def _note(self, event: str, seq: Any) -> None:
        if self.trace is not None:
            self.trace.append((self.steps, event, seq.order))

    def tick(self) -> None:
        self.steps += 1

    def add(self, seq: Any) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.rows)

    # -- admission -------------------------------------------------------------------------------

    def admit(self) -> list[Any]:
        """Move waiting rows to running by the rule (module docstring); returns the rows admitted, in order."""
        cap = self.cap
        reserved = sum(s.reserved for s in self.rows) if cap is not None else 0
        bs = self.pool.block_size
        promised: dict[int, int] = {}
        for s in self.rows:
            if not s.ready:
                promised[hash(tuple(s.tokens))] = blocks_for(len(s.tokens), bs) - len(s.table)
        room = self.pool.free_blocks - watermark_blocks(self.pool.num_blocks) - sum(promised.values())
        admitted = []
        while self.waiting:
            seq = self.waiting[0]
            key = hash(tuple(seq.tokens))
            need = 0 if key in promised else blocks_for(len(seq.tokens), bs)
            if not admits(running=len(self.rows), max_concurrent=self.max_concurrent, room_blocks=room,
                          need_blocks=need, cap=cap, reserved=reserved, need_reserved=seq.reserved):
                break
            self.waiting.popleft()
            reserved += seq.reserved
            room -= need
            promised[key] = need
            seq.reset_kv()
            self.rows.append(seq)
            admitted.append(seq)
            self._note("admit", seq)
        return admitted

    # -- blocks and preemption -------------------------------------------------------------------

    def secure(self, seq: Any, start: int, end: int, keep: set[int], preempt: bool = True) -> bool:
        """Blocks of its own for positions [start, end) of `seq`, preempting the youngest rows outside `keep`
        (ids) while the pool is short; False when `seq` itself was preempted or `preempt` is off."""
        hint = blocks_for(seq.reserved, self.pool.block_size)  # where a new run goes (kvcache.py, Placement)
        while not (self.pool.ensure(seq.table, end, hint) and self.pool.writable(seq.table, start, end, hint)):
            victims = [s for s in self.rows if id(s) not in keep]
            if not preempt or not victims:
                return False
            victim = max(victims, key=lambda s: s.order)
            self.preempt(victim)
            if victim is seq:
                return False
        return True

    def preempt(self, seq: Any) -> None:
        """Free `seq`'s blocks and queue it first, to be recomputed from its tokens when blocks are free."""
        self.rows.remove(seq)
        self.preempted += 1
        self.preempted_tokens += seq.kv_len
        self.pool.release(seq.table)
        seq.reset_kv()
        self.waiting.appendleft(seq)
        self._note("preempt", seq)

    def remove(self, seq: Any) -> None:
        """A finished or aborted row leaves; its blocks go back to the pool (shared ones when unreferenced)."""
        self.rows.remove(seq)
        self.pool.release(seq.table)
        self._note("finish", seq)

    def abort(self, seq: Any) -> None:
        if seq in self.waiting:
            self.waiting.remove(seq)
        else:
            self.remove(seq)

    def drop_kv(self) -> int:
        """A weight update invalidated every row's KV (kv_on_update: recompute): free it, shortest rows first (they
        resume decoding soonest), and rebuild through prefill in recompute_chunk_tokens chunks. Returns the tokens
        whose KV was dropped."""
        self.recomputing = {id(s) for s in self.rows}
        self.rows.sort(key=lambda s: len(s.tokens))
        stale = 0
        for seq in self.rows:
            stale += seq.kv_len
            self.pool.release(seq.table)
            seq.reset_kv()
        return stale

    # -- prefill and decode ----------------------------------------------------------------------

    def plan_prefill(self, scale: int = 1) -> PrefillPlan:
        """The chunks to compute this step (module docstring). Rows preempt others for blocks only when no row is
        ready to decode (decoding frees blocks otherwise). `scale`: budget multiplier (the twin's strided steps)."""
        budget = self.prefill_chunk_tokens
        if self.recomputing:  # rows whose KV a weight update dropped: larger chunks, sized by their own budget
            self.recomputing &= {id(s) for s in self.rows if not s.ready}
            budget = max(budget, self.recompute_chunk_tokens) if self.recomputing else budget
        budget *= scale
        plan = PrefillPlan()
        leaders: dict[tuple[int, int], list[int]] = {}  # (start, kv_sig) -> indices into chunks
        preempt = not any(s.ready for s in self.rows)
        for seq in [s for s in self.rows if not s.ready]:
            if seq not in self.rows:
                continue  # preempted for an older row this step
            if self.share_prefill and (j := self._shared_chunk(seq, leaders, plan.chunks)) is not None:
                plan.followers.append((seq, j))
                continue
            if budget <= 0:
                continue  # no compute left this step, but later rows may still follow a leader
            take = min(len(seq.tokens) - 1 - seq.kv_len, budget)
            if not self.secure(seq, seq.kv_len, seq.kv_len + take, {id(s) for s in plan.picked}, preempt):
                if seq in self.rows:
                    break  # FIFO: later rows wait for blocks too
                continue
            leaders.setdefault((seq.kv_len, seq.kv_sig), []).append(len(plan.chunks))
            plan.picked.append(seq)
            plan.starts.append(seq.kv_len)
            plan.chunks.append(seq.tokens[seq.kv_len : seq.kv_len + take])
            budget -= take
        return plan

    def commit_prefill(self, plan: PrefillPlan, version: int) -> int:
        """The engine computed `plan`'s chunks under weights `version`: advance the rows' KV, point the followers at
        the leaders' blocks. Returns the tokens the followers took without computing them."""
        for seq, chunk in zip(plan.picked, plan.chunks):
            seq.advance_kv(chunk, version)
        shared = 0
        for seq, j in plan.followers:
            if seq not in self.rows:
                continue
            end = plan.starts[j] + len(plan.chunks[j])
            self.pool.release(seq.table)  # identical KV (same kv_sig) in other blocks, or the same ones
            seq.table = self.pool.share(plan.picked[j].table, blocks_for(end, self.pool.block_size))
            seq.advance_kv(plan.chunks[j], version)
            shared += len(plan.chunks[j])
        return shared

    @staticmethod
    def _shared_chunk(seq: Any, leaders: dict, chunks: list[list[int]]) -> int | None:
        """Index of a chunk computed this step that `seq` can share: same start, same KV history (kv_sig
        covers tokens and weight versions so far) and the same next tokens."""
        for j in leaders.get((seq.kv_len, seq.kv_sig), ()):
            chunk = chunks[j]
            end = seq.kv_len + len(chunk)
            if end <= len(seq.tokens) - 1 and seq.tokens[seq.kv_len:end] == chunk:
                return j
        return None

    def decode_rows(self, width: int = 1) -> list[Any]:
        """Ready rows, oldest first, each with its own blocks for the `width` positions it writes next (the engine:
        1; the twin's strided steps: more), preempting the youngest rows while the pool is short; in row order."""
        keep: set[int] = set()
        for seq in sorted((s for s in self.rows if s.ready), key=lambda s: s.order):
            if seq in self.rows:
                p = len(seq.tokens) - 1
                if self.secure(seq, p, p + width, keep):
                    keep.add(id(seq))
        return [s for s in self.rows if id(s) in keep]
