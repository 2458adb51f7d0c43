"""Keeps benchmarks/speed/reward.py from rotting: its --quick mode runs and writes the documented JSON shape.
No speed is asserted (benchmarks measure speed; see benchmarks/RESULTS.md).

Run: pytest tests/integration/test_reward_benchmark.py -q -m slow   (~60 s)
"""
import pytest

from .bench_smoke import run_quick


@pytest.mark.slow
def test_reward_benchmark_quick_mode(tmp_path):
    report, stdout = run_quick("speed/reward.py", tmp_path, timeout=300)
    assert {r["mode"] for r in report["results"]} == {"direct", "pool-1", "pool-2", "routed-1", "routed-2"}
    assert all(r["rewards_per_s"] > 0 for r in report["results"])
    assert set(report["targets"]) == {"two_vs_one_worker", "routed_vs_direct"} <= set(report["ratios"])
    assert "two_vs_one_worker" in stdout and "reproduce:" in stdout
