"""Keeps benchmarks/broker.py from rotting: its --quick mode runs and writes the documented JSON shape.
No speed is asserted (benchmarks measure speed; see benchmarks/RESULTS.md).

Run: pytest tests/integration/test_broker_benchmark.py -q -m slow   (~60 s)
"""
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_broker_benchmark_quick_mode(tmp_path):
    out = tmp_path / "broker.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "broker.py"), "--quick", "--json", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["benchmark"] == "broker" and report["quick"] is True
    assert set(report["ratios"]) == set(report["targets"]) == {"routed_vs_direct_throughput"}
    names = [r["name"] for r in report["results"]]
    assert names == ["small_jobs", "latency_at_half_peak", "large_jobs_64mib", "sample_store_64mib_arrays",
                     "heartbeat_swarm"]
    small, swarm = report["results"][0], report["results"][-1]
    assert small["routed"]["round_trips_s"] > 0 and small["direct"]["round_trips_s"] > 0
    assert swarm["still_registered"] == swarm["workers"] == 1000  # heartbeats kept every worker registered
    assert "small jobs, round trips/s" in proc.stdout and "command: python benchmarks/broker.py --quick" in proc.stdout


@pytest.mark.slow
def test_security_benchmark_quick_mode(tmp_path):
    out = tmp_path / "security.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "security.py"), "--quick", "--json", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["benchmark"] == "security" and report["quick"] is True
    assert set(report["ratios"]) == set(report["targets"]) == {
        "curve_vs_plain_small_jobs", "curve_vs_plain_64mib_jobs", "curve_vs_plain_weights"}
    assert [r["name"] for r in report["results"]] == ["small_jobs", "large_jobs_64mib", "weights_transfer",
                                                       "handshake"]
    assert "curve/plain" in proc.stdout and "command: python benchmarks/security.py --quick" in proc.stdout
