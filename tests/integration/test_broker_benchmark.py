"""Keeps benchmarks/speed/broker.py and benchmarks/speed/security.py from rotting: their --quick modes run and write the
documented JSON shape. No speed is asserted (benchmarks measure speed; see benchmarks/RESULTS.md).

Run: pytest tests/integration/test_broker_benchmark.py -q -m slow   (~60 s each)
"""
import pytest

from .bench_smoke import run_quick


@pytest.mark.slow
def test_broker_benchmark_quick_mode(tmp_path):
    report, stdout = run_quick("speed/broker.py", tmp_path)
    assert set(report["ratios"]) == set(report["targets"]) == {"routed_vs_direct_throughput"}
    names = [r["name"] for r in report["results"]]
    assert names == ["small_jobs", "latency_at_half_peak", "large_jobs_64mib", "sample_store_64mib_arrays",
                     "heartbeat_swarm"]
    small, swarm = report["results"][0], report["results"][-1]
    assert small["routed"]["round_trips_s"] > 0 and small["direct"]["round_trips_s"] > 0
    assert swarm["still_registered"] == swarm["workers"] == 1000  # heartbeats kept every worker registered
    assert "small jobs, round trips/s" in stdout and "command: python benchmarks/speed/broker.py --quick" in stdout


@pytest.mark.slow
def test_security_benchmark_quick_mode(tmp_path):
    report, stdout = run_quick("speed/security.py", tmp_path)
    assert set(report["ratios"]) == set(report["targets"]) == {
        "curve_vs_plain_small_jobs", "curve_vs_plain_64mib_jobs", "curve_vs_plain_weights"}
    assert [r["name"] for r in report["results"]] == ["small_jobs", "large_jobs_64mib", "weights_transfer",
                                                       "handshake"]
    assert "curve/plain" in stdout and "command: python benchmarks/speed/security.py --quick" in stdout
