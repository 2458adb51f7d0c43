"""The scheduler twin: the torch engine's own scheduler driven in virtual time at a config's full numbers.

What: `run_twin(TwinSpec(...))` builds the engine's block pool (engines/blocks.py, bookkeeping only: no tensors) and
its scheduler (engines/scheduler.py, the same object the engine drives) at full scale — hundreds of rows, a pool of
millions of tokens — and steps it as engines/torch/engine.py `step()` does: admit, prefill, decode, finish. The
forward passes are replaced by arithmetic: each row's answer length is drawn from a stated distribution, a decoded
row appends a token, and a step costs time by a stated model (`StepCost`: sim/timing.py's roofline terms for the
config's shape). A saturated queue (the rollout worker keeps the engine fed) of GRPO groups, `group_size` samples
of one prompt each, feeds it. After a warm-up (2 x max_concurrent answers finished) it measures, weighted by
virtual time, over the next 3 x max_concurrent answers:
    rows, running    rows holding a slot (mean; the engine's stats() `running`), and that / max_concurrent: what
                     `plan` prints as "engine rows running"
    decoding         rows decoding a token / max_concurrent (a row still prefilling or recomputing produces nothing)
    preempt_per_1k   preemptions per 1,000 generated tokens
    kv_use           blocks in use / pool blocks
    tokens_per_s     generated tokens per virtual second under the stated step cost

Strided steps: at full scale a step of the twin stands for `stride` engine steps: a decoding row secures blocks for
`stride` positions and appends that many tokens (fewer when its answer ends), and the prefill budget is `stride`
chunks. Decisions are still the scheduler's, at a block's granularity or coarser (stride <= 64 tokens, at most an
8k answer's 1/128); at stride 1 the twin is step for step the engine (tests/unit/engines/test_twin.py holds its
admissions, preemptions and finishes equal to a real engine's on the CPU).

vLLM: its own scheduler is not importable without vLLM and a GPU; the twin stands in with vLLM's admission settings
(max_num_seqs = rollout.engine.max_concurrent, max_num_batched_tokens as the prefill budget, the pool from
gpu_memory_utilization, 16-token blocks, prefix caching as shared prefill, no reservation cap). vLLM v1 also admits
while blocks allow and preempts the latest request by recompute; its watermark and ordering details differ.
"""
from __future__ import annotations

import functools
import random
from dataclasses import dataclass, field

from areal_mq.engines.blocks import BlockPool
from areal_mq.engines.scheduler import Scheduler

VLLM_MAX_NUM_BATCHED_TOKENS = 8192  # vLLM v1's default token budget per step for an offline/async engine (stated)
WARM_FINISHES, MEASURE_FINISHES = 2, 3  # answers, in units of max_concurrent
MAX_TWIN_STEPS = 200_000


class TwinPool(BlockPool):
    """The block pool with placement replaced by a free list. Admission and preemption read only counts and
    reference counts (engines/scheduler.py), never where a block lies, so the decisions are the same; the engine's
    placement scan (runs, blocks.py `_run_start`) costs ~2 ms a call over a 90k-block pool, which made a full-scale
    twin take seconds."""

    def __init__(self, num_blocks: int, block_size: int):
        super().__init__(num_blocks, block_size)
        self.free_list = list(range(num_blocks - 1, -1, -1))

    def _take(self, n: int, after: int | None = None, hint: int = 0) -> list[int]:
        blocks = [self.free_list.pop() for _ in range(n)]
        for b in blocks:
            self.free_map[b] = 0
            self.refs[b] = 1
        self.free_blocks -= n
        self.peak_used = max(self.peak_used, self.used)
        return blocks

    def _freed(self, block: int) -> None:
        self.free_list.append(block)


@dataclass(eq=False)
class TwinRow:
    """A request as the scheduler sees it (engines/torch/seq.py SeqState's scheduling fields), with its answer length
    drawn up front. Generated tokens are this row's own id (never equal to another row's: no false sharing)."""
    tokens: list[int]
    n_prompt: int
    reserved: int
    order: int
    target: int  # answer tokens it will generate
    table: list[int] = field(default_factory=list)
    kv_len: int = 0
    kv_sig: int = 0

    @property
    def ready(self) -> bool:
        return self.kv_len == len(self.tokens) - 1

    @property
    def generated(self) -> int:
        return len(self.tokens) - self.n_prompt

    def advance_kv(self, tokens: list[int], version: int) -> None:
        self.kv_len += len(tokens)
        self.kv_sig = hash((self.kv_sig, version, tuple(tokens)))

    def reset_kv(self) -> None:
        self.kv_len, self.kv_sig = 0, 0


@dataclass(frozen=True)
class StepCost:
    """Virtual seconds of one engine step: fixed + (weights + KV read by the decoding rows) / bandwidth + prefill
    tokens x seconds per token (sim/timing.py `TimingModel` terms; `roofline` scales its H800 figures to a shape)."""
    fixed_s: float = 4e-3
    weight_bytes: float = 0.0
    kv_bytes_per_token: float = 0.0
    bandwidth: float = 2.0e12
    prefill_s_per_token: float = 0.0
    source: str = "unit: every step 4 ms"

    @classmethod
    def roofline(cls, params: float, weight_width: int, kv_bytes_per_token: float) -> "StepCost":
        from areal_mq.sim.timing import timing_model

        tm = timing_model("r1-1.5b-h800-roofline")
        return cls(tm.decode_fixed_s, params * weight_width, kv_bytes_per_token, tm.mem_bw_bytes_per_s,
                   tm.prefill_s_per_token * params / 1.54e9, f"{tm.name} (sim/timing.py) scaled to the shape")

    def step_s(self, decoding: int, context_tokens: int, prefill_tokens: int) -> float:
        read = (self.weight_bytes + context_tokens * self.kv_bytes_per_token) if decoding else 0.0
        return self.fixed_s + read / self.bandwidth + prefill_tokens * self.prefill_s_per_token


@dataclass(frozen=True)
class TwinSpec:
    """One engine at full scale (hashable: results are cached per spec)."""
    max_concurrent: int
    pool_tokens: int
    block_size: int
    prefill_chunk_tokens: int
    prompt_tokens: int
    max_new_tokens: int
    group_size: int = 1
    cap: int | None = None
    share_prefill: bool = True
    lengths: tuple[int, ...] = ()  # measured answer lengths to draw from (scaled to max_new_tokens); () = uniform
    lengths_source: str = ""
    cost: StepCost = StepCost()
    seed: int = 0
    stride: int = 0  # 0: chosen (module docstring)

    def chosen_stride(self) -> int:
        return self.stride or max(1, min(64, self.max_new_tokens // 128))

    def draw(self, rng: random.Random) -> int:
        if self.lengths:
            top = max(self.lengths)
            return max(1, min(self.max_new_tokens, round(rng.choice(self.lengths) * self.max_new_tokens / top)))
        return rng.randint(1, self.max_new_tokens)

    def lengths_said(self) -> str:
        if self.lengths:
            return self.lengths_source or f"{len(self.lengths)} measured lengths scaled to {self.max_new_tokens}"
        return f"uniform over [1, {self.max_new_tokens}] tokens (stated, not measured)"


class Twin:
    """The scheduler stepped in virtual time (module docstring); `step()` mirrors TorchEngine.step()."""

    def __init__(self, spec: TwinSpec, rows: list[TwinRow] | None = None):
        self.spec = spec
        self.pool = TwinPool(spec.pool_tokens // spec.block_size, spec.block_size)
        self.sched = Scheduler(self.pool, max_concurrent=spec.max_concurrent,
                               prefill_chunk_tokens=spec.prefill_chunk_tokens, share_prefill=spec.share_prefill,
                               max_reserved_tokens=spec.cap)
        self.rng = random.Random(spec.seed)
        self.fixed = rows is not None  # a given request list (the equality test) instead of a saturated queue
        self.submitted = 0
        for row in rows or []:
            self.sched.add(row)
            self.submitted += 1
        self.clock = 0.0
        self.last_running = self.last_decoding = 0
        self.generated = 0
        self.finished: list[TwinRow] = []

    def _feed(self) -> None:
        """Keep max_concurrent requests waiting: groups of group_size samples of one fresh prompt."""
        s = self.spec
        while len(self.sched.waiting) < s.max_concurrent:
            prompt = [(self.submitted * 7919 + i) % 1_000_003 for i in range(s.prompt_tokens)]
            for _ in range(s.group_size):
                self.sched.add(TwinRow(tokens=list(prompt), n_prompt=len(prompt), order=self.submitted,
                                       reserved=len(prompt) + s.max_new_tokens, target=s.draw(self.rng)))
                self.submitted += 1

    def step(self, stride: int = 1) -> float:
        """One (strided) engine step; returns its virtual seconds."""
        if not self.fixed:
            self._feed()
        sched = self.sched
        sched.admit()
        plan = sched.plan_prefill(scale=stride)
        prefilled = sum(len(c) for c in plan.chunks)
        if plan.picked:
            sched.commit_prefill(plan, 0)
        rows = sched.decode_rows(stride)
        self.last_running, self.last_decoding = len(sched.rows), len(rows)  # before this step's answers leave
        context = 0
        for row in rows:
            n = min(stride, row.target - row.generated)
            new = [1_000_003 + row.order] * n
            row.advance_kv(row.tokens[-1:] + new[:-1], 0)
            row.tokens.extend(new)
            context += len(row.tokens)
            self.generated += n
            if row.generated >= row.target:
                sched.remove(row)
                self.finished.append(row)
        sched.tick()
        dt = self.spec.cost.step_s(len(rows), context, prefilled) * (stride if rows else 1)
        self.clock += dt
        return dt


@functools.lru_cache(maxsize=64)
def run_twin(spec: TwinSpec) -> dict:
    """Steady-state figures of one engine at full scale (module docstring)."""
    twin, stride, mc = Twin(spec), spec.chosen_stride(), spec.max_concurrent
    warm, end = WARM_FINISHES * mc, (WARM_FINISHES + MEASURE_FINISHES) * mc
    acc = {"t": 0.0, "rows": 0.0, "decoding": 0.0, "used": 0.0}
    start = None
    for _ in range(MAX_TWIN_STEPS):
        if len(twin.finished) >= end:
            break
        if start is None and len(twin.finished) >= warm:
            start = (twin.generated, twin.sched.preempted)
        dt = twin.step(stride)
        if start is not None:
            acc["t"] += dt
            acc["rows"] += dt * twin.last_running
            acc["decoding"] += dt * twin.last_decoding
            acc["used"] += dt * twin.pool.used
    if start is None or acc["t"] <= 0:
        raise RuntimeError(f"the twin did not reach steady state in {MAX_TWIN_STEPS} steps ({len(twin.finished)} "
                           f"answers finished of {warm} for the warm-up): {spec}")
    tokens = twin.generated - start[0]
    t = acc["t"]
    return {"rows": round(acc["rows"] / t, 1), "max_concurrent": mc, "running": round(acc["rows"] / t / mc, 4),
            "decoding": round(acc["decoding"] / t / mc, 4), "decoding_rows": round(acc["decoding"] / t, 1),
            "preempt_per_1k": round(1000 * (twin.sched.preempted - start[1]) / max(1, tokens), 3),
            "kv_use": round(acc["used"] / t / max(1, twin.pool.num_blocks), 4),
            "tokens_per_s": round(tokens / t, 1), "pool_tokens": spec.pool_tokens, "stride": stride,
            "answers": len(twin.finished) - warm, "lengths": spec.lengths_said(), "cost": spec.cost.source}
