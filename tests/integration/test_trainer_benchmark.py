"""Keeps benchmarks/speed/trainer.py from rotting: its --quick mode runs and writes the documented JSON shape.
No speed is asserted (benchmarks measure; tests check). Slow: SmolLM2-135M trains a few steps."""
from __future__ import annotations

import pytest

from .bench_smoke import run_quick


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_trainer_benchmark_quick_runs(tmp_path):
    report, stdout = run_quick("speed/trainer.py", tmp_path, timeout=1100)
    assert set(report["ratios"]) == set(report["targets"]) == {"packed_vs_padded_tokens_per_s",
                                                               "shared_vs_dynamic_tokens_per_s"}
    assert all(v > 0 for v in report["ratios"].values())
    names = [r["name"] for r in report["results"]]
    assert names == ["setup", "packed", "padded", "shared"]
    by = {r["name"]: r for r in report["results"]}
    assert by["shared"]["computed_tokens_per_step"] < by["packed"]["computed_tokens_per_step"]
    table = stdout.strip().splitlines()
    assert table[0].startswith("metric") and "training tokens/s" in stdout
    assert any(line.startswith("command: python benchmarks/speed/trainer.py --quick") for line in table)
