"""Keeps benchmarks/quality/mismatch.py from rotting, and checks what it measures on the real SmolLM2 weights: the same
weights in fp32 on both sides agree to float rounding, a bf16 engine and trainer do not (mismatch_kl is a
property of numerics, not a constant). Slow: three short generations and trainer steps."""
from __future__ import annotations

import pytest

from .bench_smoke import run_quick


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_mismatch_benchmark_quick_measures_bf16_against_fp32(tmp_path):
    report, stdout = run_quick("quality/mismatch.py", tmp_path, timeout=800)
    by = {(r["engine_dtype"], r["trainer_precision"]): r for r in report["results"]}
    assert set(by) == {("float32", "fp32"), ("bfloat16", "bf16"), ("bfloat16", "fp32")}
    assert all(r["tokens"] > 0 for r in by.values())
    assert by[("float32", "fp32")]["mismatch_kl"] < 1e-6
    assert by[("bfloat16", "bf16")]["mismatch_kl"] > 100 * by[("float32", "fp32")]["mismatch_kl"]
    assert report["ratios"]["bf16_vs_fp32_mismatch_kl"] > 100
    assert "bf16_vs_fp32_mismatch_kl" in stdout and "reproduce: python benchmarks/quality/mismatch.py --quick" in stdout
