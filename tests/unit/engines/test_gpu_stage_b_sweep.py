"""benchmarks/gpu/stage_b_engine.py's decode sweep when prefilling takes more engine steps than the timed decode:
the rows prefilled first decode while the others prefill, so each request needs that many tokens of room. On
an H200 (2026-11-26) the 128 x 1,024 point ran out of it: the first rows finished before the last ones started,
and the loop waiting for a step that decodes every row spun on an idle engine until the stage was killed."""
from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

GPU_BENCH = Path(__file__).resolve().parents[3] / "benchmarks" / "gpu"


@pytest.fixture(scope="module")
def stage_b():
    sys.path.insert(0, str(GPU_BENCH))  # report.py then adds benchmarks/ (engine.py)
    try:
        yield importlib.import_module("stage_b_engine")
    finally:
        sys.path.remove(str(GPU_BENCH))


@pytest.mark.timeout(120)
def test_a_sweep_point_whose_prefill_outlasts_the_timed_steps_completes(stage_b, make_engine, tiny_tokenizer):
    batch, context, steps = 8, 32, 3  # 256 prompt tokens at 16 per step: 16 prefill steps > steps + 8
    engine = make_engine(max_concurrent=batch, prefill_chunk_tokens=16, max_model_len=context + 64,
                         max_kv_tokens=batch * (context + 64))
    assert stage_b.prefill_steps(engine, batch, context) == 18
    point = stage_b.sweep_point(engine, SimpleNamespace(device="cpu"), batch, context, steps, len(tiny_tokenizer))
    assert point["batch"] == batch and point["prefill_tokens"] == batch * context
    assert point["step_s"] > 0 and point["prefill_s"] > 0
    assert not engine.has_work()
