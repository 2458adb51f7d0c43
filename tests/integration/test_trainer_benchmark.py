"""Keeps benchmarks/trainer.py from rotting: its --quick mode runs and writes the documented JSON shape.
No speed is asserted (benchmarks measure; tests check). Slow: SmolLM2-135M trains a few steps."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_trainer_benchmark_quick_runs(tmp_path):
    out = tmp_path / "trainer.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "trainer.py"), "--quick", "--json", str(out)],
                          capture_output=True, text=True, timeout=1100, cwd=ROOT, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["benchmark"] == "trainer" and report["quick"] is True
    assert set(report["ratios"]) == set(report["targets"]) == {"packed_vs_padded_tokens_per_s",
                                                               "shared_vs_dynamic_tokens_per_s"}
    assert all(v > 0 for v in report["ratios"].values())
    names = [r["name"] for r in report["results"]]
    assert names == ["setup", "packed", "padded", "shared"]
    by = {r["name"]: r for r in report["results"]}
    assert by["shared"]["computed_tokens_per_step"] < by["packed"]["computed_tokens_per_step"]
    table = proc.stdout.strip().splitlines()
    assert table[0].startswith("metric") and "training tokens/s" in proc.stdout
    assert any(line.startswith("command: python benchmarks/trainer.py --quick") for line in table)
