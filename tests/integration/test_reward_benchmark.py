"""Keeps benchmarks/reward.py from rotting: its --quick mode runs and writes the documented JSON shape.
No speed is asserted (benchmarks measure speed; see benchmarks/RESULTS.md).

Run: pytest tests/integration/test_reward_benchmark.py -q -m slow   (~60 s)
"""
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_reward_benchmark_quick_mode(tmp_path):
    out = tmp_path / "reward.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "reward.py"), "--quick", "--json", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["benchmark"] == "reward" and report["quick"] is True
    assert {r["mode"] for r in report["results"]} == {"direct", "pool-1", "pool-2", "routed-1", "routed-2"}
    assert all(r["rewards_per_s"] > 0 for r in report["results"])
    assert set(report["targets"]) == {"two_vs_one_worker", "routed_vs_direct"} <= set(report["ratios"])
    assert "two_vs_one_worker" in proc.stdout and "reproduce:" in proc.stdout
