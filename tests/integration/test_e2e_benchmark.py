"""benchmarks/speed/e2e.py --quick once, so the sync-vs-async benchmark does not rot (slow: four whole-system runs).

Checks the JSON shape of BENCHMARKS.md, that every run trained the same number of samples, that
each mode's staleness respects its bound, that evaluations and the plot were produced and that the
weights were cleaned up. No speed is asserted (benchmarks measure speed; this only keeps the code path alive).
"""
from __future__ import annotations

import math
from pathlib import Path

import pytest

from .bench_smoke import run_quick

pytestmark = pytest.mark.slow


@pytest.mark.timeout(1500)
def test_quick_benchmark_writes_the_documented_json(tmp_path):
    png = tmp_path / "acc.png"
    report, stdout = run_quick("speed/e2e.py", tmp_path, "--out", str(tmp_path / "runs"), "--plot", str(png), timeout=1400)
    assert set(report) >= {"benchmark", "quick", "machine", "results", "ratios", "targets"}
    assert report["targets"] == {"async_vs_sync_samples_per_s": 1.5}
    assert set(report["ratios"]) == {"async_vs_sync_samples_per_s", "async_eta4_vs_sync_samples_per_s"}
    assert all(math.isfinite(v) and v > 0 for v in report["ratios"].values())

    setup, *modes = report["results"]
    assert setup["kind"] == "setup" and setup["model"] == "tiny-random-llama"
    assert [m["name"] for m in modes] == ["sync", "async_eta2", "async_eta4", "sync_repeat"]
    expected = setup["total_steps"] * setup["batch_groups"] * setup["group_size"]
    for m in modes:
        assert m["samples"] == expected, f"{m['name']} trained {m['samples']} samples, expected {expected}"
        assert m["steps"] == setup["total_steps"]
        assert m["staleness_max"] <= m["eta"]
        assert m["train_window_s"] > 0 and m["samples_per_s"] > 0
        assert [e["version"] for e in m["evals"]] == setup["eval_versions"]
        assert all(e["n"] == setup["eval_n"] and 0 <= e["strict"] <= 1 and 0 <= e["lenient"] <= 1 for e in m["evals"])
        assert m["final"]["version"] == setup["total_steps"]
        assert not (Path(m["run_dir"]) / "weights").exists(), "weights should be deleted without --keep-weights"
    assert {m["threads"]["rollout"] for m in modes} == {1, 2}
    ratio = modes[1]["samples_per_s"] / ((modes[0]["samples_per_s"] + modes[3]["samples_per_s"]) / 2)
    assert report["ratios"]["async_vs_sync_samples_per_s"] == pytest.approx(ratio)

    assert png.stat().st_size > 10_000
    lines = stdout.strip().splitlines()
    assert lines[-2].startswith("command: python benchmarks/speed/e2e.py --quick")
    assert any(line.startswith("async_vs_sync_samples_per_s") for line in lines)
