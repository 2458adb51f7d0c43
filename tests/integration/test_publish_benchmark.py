"""Keeps benchmarks/speed/publish.py from rotting: its --quick mode runs the real Trainer and WeightPublisher with the
publish in the step and in the background, for zmq and disk, and writes the documented JSON shape. No speed is
asserted (benchmarks measure; tests check)."""
from __future__ import annotations

import pytest

from .bench_smoke import run_quick


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_publish_benchmark_quick_runs(tmp_path):
    report, stdout = run_quick("speed/publish.py", tmp_path, timeout=500)
    assert set(report["ratios"]) == {"sync_vs_async_blocked_zmq", "sync_vs_async_blocked_disk"}
    rows = {(r["mode"], r["background"]) for r in report["results"]}
    assert rows == {("zmq", False), ("zmq", True), ("disk", False), ("disk", True)}
    assert all(len(r["blocked_s"]) == report["steps"] and r["ready_median_s"] >= 0 for r in report["results"])
    assert "reproduce: python benchmarks/speed/publish.py --quick" in stdout
