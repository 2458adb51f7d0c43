"""Keeps benchmarks/speed/engine.py from rotting: its --quick mode runs end to end (on the tiny model here,
so it stays fast) and writes the documented JSON shape. No speed is asserted."""
from __future__ import annotations

import pytest

from tests.integration.bench_smoke import run_quick


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_engine_benchmark_quick_runs(tmp_path, tiny_model_dir):
    report, stdout = run_quick("speed/engine.py", tmp_path, "--model", str(tiny_model_dir), "--dtype", "float32",
                               timeout=580)
    assert set(report["ratios"]) == set(report["targets"]) >= {"uniform_vs_hf_generate", "longtail_vs_hf_generate"}
    engines = {(r["workload"], r["engine"]) for r in report["results"]}
    assert {("uniform", "torch_engine"), ("longtail", "hf_generate"), ("longtail", "contiguous_engine")} <= engines
    assert {"paged_vs_contiguous_uniform", "paged_vs_contiguous_longtail"} <= set(report["ratios"])
    assert "reproduce: python benchmarks/speed/engine.py --quick" in stdout


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_engine_reasoning_benchmark_quick_runs(tmp_path, tiny_model_dir):
    report, stdout = run_quick("speed/engine.py", tmp_path, "--reasoning", "--model", str(tiny_model_dir),
                               "--dtype", "float32", timeout=280)
    assert report["mode"] == "reasoning" and set(report["ratios"]) == set(report["targets"]) == {
        "contiguous_vs_paged_concurrency", "paged_vs_contiguous_tokens_per_s"}
    assert {r["engine"] for r in report["results"]} == {"paged", "contiguous"}
    assert "reproduce: python benchmarks/speed/engine.py --reasoning --quick" in stdout


@pytest.mark.timeout(300)
def test_engine_decode_benchmark_quick_runs(tmp_path, tiny_model_dir):
    report, stdout = run_quick("speed/engine.py", tmp_path, "--decode", "--model", str(tiny_model_dir),
                               "--dtype", "float32", timeout=280)
    assert report["mode"] == "decode" and set(report["ratios"]) == set(report["targets"]) == {
        "paged_vs_contiguous_decode_uniform_1024", "paged_vs_contiguous_decode_uniform_300",
        "paged_vs_contiguous_decode_longtail"}
    assert "reproduce: python benchmarks/speed/engine.py --decode --quick" in stdout


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_engine_eval_benchmark_quick_runs(tmp_path, tiny_model_dir):
    """The quickstart's held-out evaluation on both engines: same greedy answers, one ratio (issue 51 item 4)."""
    report, stdout = run_quick("speed/engine.py", tmp_path, "--eval", "--model", str(tiny_model_dir))
    assert report["mode"] == "eval" and set(report["ratios"]) == set(report["targets"]) == {"paged_vs_contiguous_eval"}
    assert report["workload"]["problems"] == 32 and report["workload"]["differing_answers"] <= 1
    assert "reproduce: python benchmarks/speed/engine.py --eval --quick" in stdout


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_engine_admission_benchmark_quick_runs(tmp_path):
    """Issue 59: SmolLM2 with 64 rows of 8,000-token answers runs all 64 under the pool rule and 8 under the old
    reservation cap; a pool too small for the rows fills and preempts. Rows, not speed, are asserted."""
    report, stdout = run_quick("speed/engine.py", tmp_path, "--admission", timeout=280)
    assert report["mode"] == "admission"
    pool, reserved, small = report["results"]
    assert pool["running"] == 64 and reserved["running"] == 8 and reserved["waiting"] == 56
    assert small["kv_blocks_used"] >= 0.9 * small["kv_blocks"] and small["preempted"] > 0
    assert report["ratios"]["pool_admission_fill"] >= 0.9
    assert "reproduce: python benchmarks/speed/engine.py --admission --quick" in stdout
