"""Keeps benchmarks/speed/scale.py from rotting: its --quick mode (real job broker, bus and store processes, the real
controller, the simulated trainer and a swarm of 64 simulated rollout workers; sync and async η=2) runs and
writes the documented JSON shape. No speed is asserted: only what holds on any machine — both modes trained the
same number of sequences, no trained sequence was staler than its mode's η, every simulated worker's dispatch
probe went through the broker, and the headline ratio key exists.

Run: pytest tests/integration/test_scale_benchmark.py -q -m slow   (~40 s)
"""
import pytest

from .bench_smoke import run_quick


@pytest.mark.slow
def test_scale_benchmark_quick_mode(tmp_path):
    report, stdout = run_quick("speed/scale.py", tmp_path, timeout=300)
    assert set(report["ratios"]) == set(report["targets"]) == {"async_vs_sync_samples_per_s_64"}
    sync, async_ = report["results"]
    assert (sync["name"], async_["name"], sync["n"], async_["n"]) == ("sync", "async_eta2", 64, 64)
    assert sync["trained_seqs"] == async_["trained_seqs"] == report["settings"]["steps"] * 64 * 4
    assert set(sync["staleness"]) == {"0"} and max(int(k) for k in async_["staleness"]) <= 2
    for r in (sync, async_):
        assert r["samples_per_s"] > 0 and 0 <= r["gpu_idle"] <= 1 and r["probes"] > 0
        assert set(r["cpu_pct"]) == {"job", "bus", "store", "controller", "swarm"}
    assert "async_vs_sync_samples_per_s_64" in stdout and "command: python benchmarks/speed/scale.py --quick" in stdout
