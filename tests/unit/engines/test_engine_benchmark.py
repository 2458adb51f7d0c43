"""Keeps benchmarks/engine.py from rotting: its --quick mode runs end to end (on the tiny model here,
so it stays fast) and writes the documented JSON shape. No speed is asserted."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_engine_benchmark_quick_runs(tmp_path, tiny_model_dir):
    out = tmp_path / "engine.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "engine.py"), "--quick", "--model", str(tiny_model_dir),
         "--dtype", "float32", "--json", str(out)],
        capture_output=True, text=True, timeout=580,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["benchmark"] == "engine" and report["quick"] is True
    assert set(report["ratios"]) == set(report["targets"]) >= {"uniform_vs_hf_generate", "longtail_vs_hf_generate"}
    engines = {(r["workload"], r["engine"]) for r in report["results"]}
    assert {("uniform", "torch_engine"), ("longtail", "hf_generate")} <= engines
    assert "reproduce: python benchmarks/engine.py --quick" in proc.stdout
