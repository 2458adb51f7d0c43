"""The scheduler twin (engines/twin.py): at stride 1 it makes the real engine's decisions, step by step; at full
scale it finds what the old reservation cap and a too-small pool cost, and what a sized pool runs."""
from __future__ import annotations

import pytest

from areal_mq.engines.base import EngineRequest
from areal_mq.engines.twin import StepCost, Twin, TwinRow, TwinSpec, run_twin
from areal_mq.messages import SamplingSpec

from .test_torch_engine import run_all
from .test_torch_paged import PER_TOKEN

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("share", [True, False])
def test_twin_admits_preempts_and_finishes_as_the_engine_does_step_by_step(make_engine, prompts, share):
    # a tight pool (12 blocks of 16), 4 slots, chunked prefill, two GRPO-like pairs (shared prompts) and lengths that
    # differ: admissions wait for blocks, the youngest rows are preempted and recomputed, slots refill
    lengths = [70, 25, 60, 40, 55, 30]
    order = [0, 0, 1, 2, 2, 3]  # which prompt each request samples
    engine = make_engine(max_concurrent=4, kv_cache_bytes=PER_TOKEN * 16 * 13, prefill_chunk_tokens=24,
                         share_prefill=share)
    engine.sched.trace = []
    for i, (p, n) in enumerate(zip(order, lengths)):
        engine.submit(EngineRequest(f"r{i}", prompts[p], SamplingSpec(temperature=1.0, max_new_tokens=n,
                                                                       ignore_eos=True, seed=i)))
    outs = run_all(engine)
    assert [len(outs[f"r{i}"].output_ids) for i in range(len(lengths))] == lengths

    c = engine.cfg
    spec = TwinSpec(max_concurrent=c.max_concurrent, pool_tokens=engine.cache.capacity_tokens,
                    block_size=c.kv_block_size, prefill_chunk_tokens=c.prefill_chunk_tokens, prompt_tokens=0,
                    max_new_tokens=max(lengths), share_prefill=share)
    rows = [TwinRow(tokens=list(prompts[p]), n_prompt=len(prompts[p]), reserved=len(prompts[p]) + n, order=i,
                    target=n) for i, (p, n) in enumerate(zip(order, lengths))]
    twin = Twin(spec, rows)
    twin.sched.trace = []
    while twin.sched.has_work():
        twin.step(1)
    assert twin.sched.trace == engine.sched.trace
    events = {e for _, e, _ in engine.sched.trace}
    assert events == {"admit", "preempt", "finish"}  # the case exercises every decision
    assert twin.sched.steps == engine.stats()["steps"] and twin.sched.preempted == engine.stats()["preempted"]


def spec(**kw) -> TwinSpec:
    base = dict(max_concurrent=256, pool_tokens=1_500_000, block_size=16, prefill_chunk_tokens=2048, prompt_tokens=256,
                max_new_tokens=8192, group_size=8, cost=StepCost.roofline(1.54e9, 2, 28_672))
    return TwinSpec(**{**base, **kw})


def test_a_pool_sized_for_the_rows_runs_them_all_and_the_old_cap_ran_seven():
    full = run_twin(spec())
    assert full["running"] >= 0.9 and full["preempt_per_1k"] == 0 and 0.3 < full["kv_use"] < 0.8
    old_cap = run_twin(spec(cap=65_536))  # the default cap of before issue 59: 65,536 // (256 + 8192) = 7 rows
    assert old_cap["rows"] == pytest.approx(7, abs=0.5) and old_cap["running"] < 0.05 and old_cap["decoding"] < 0.05
    assert full["tokens_per_s"] > 10 * old_cap["tokens_per_s"]


def test_a_pool_too_small_for_the_rows_preempts_and_says_so():
    small = run_twin(spec(max_concurrent=64, pool_tokens=46_576, max_new_tokens=8000))
    assert small["running"] < 0.5 and small["preempt_per_1k"] > 0 and small["kv_use"] > 0.9


@pytest.mark.parametrize("measured", [(10, 20, 30, 40, 200), (20, 30, 40, 50, 60, 100)])
def test_the_twin_draws_the_stated_lengths_and_agrees_with_the_steady_state_formula(measured):
    # measured lengths are scaled so that the longest is max_new_tokens; a pool-bound engine then decodes about as
    # many rows as engines/admission.py's length-biased formula says (pool / (prompt + E[L^2] / 2 E[L]))
    from areal_mq.engines.admission import AnswerLengths, steady_rows

    kw = dict(max_concurrent=96, pool_tokens=200_000, block_size=16, prompt_tokens=256, max_new_tokens=8192)
    for lengths in (measured, ()):
        twin = run_twin(spec(**kw, lengths=lengths, seed=1, group_size=1))  # prompts counted per row
        scaled = [round(x * 8192 / max(lengths)) for x in lengths] if lengths else None
        stated = AnswerLengths.measured(scaled, "") if scaled else None
        formula = steady_rows(**kw, lengths=stated)
        assert ("measured" if lengths else "uniform") in twin["lengths"]
        assert twin["decoding_rows"] == pytest.approx(formula["rows"], rel=0.15), (lengths, twin, formula)
