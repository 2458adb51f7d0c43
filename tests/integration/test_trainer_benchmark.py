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


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_trainer_lora_benchmark_quick_runs(tmp_path):
    """`trainer.py --lora --quick` (benchmarks/speed/trainer_lora.py): full vs LoRA on the tiny Llama, 4 processes."""
    import subprocess
    import sys

    from .bench_smoke import ROOT

    usage = subprocess.run([sys.executable, str(ROOT / "benchmarks/speed/trainer.py"), "--lora", "--help"],
                           capture_output=True, text=True, timeout=60)
    assert usage.returncode == 0 and "LoRA" in usage.stdout  # trainer.py hands --lora to trainer_lora.py
    report, stdout = run_quick("speed/trainer_lora.py", tmp_path, timeout=550)
    assert set(report["targets"]) == {"full_vs_lora_rank_memory"}
    assert set(report["ratios"]) == {"full_vs_lora_rank_memory", "full_vs_lora_rank_memory_step",
                                     "full_vs_lora_step_time"}  # quick: bf16 only
    assert all(v > 0 for v in report["ratios"].values())
    for row in report["results"]:
        full, lora = row["full"], row["lora"]
        assert full["trainable"] == full["params"] and 0 < lora["trainable"] < lora["params"]
        assert lora["base_dtype"] == ("torch.bfloat16" if row["precision"] == "bf16" else "torch.float32")
        assert all(x["peak_gib"] >= x["rss_imports_gib"] > 0 and x["plan"]["peak_gib"] > 0 for x in (full, lora))
    assert "full_vs_lora_rank_memory" in stdout and "command: python benchmarks/speed/trainer.py --lora" in stdout


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_trainer_root_units_benchmark_quick_runs(tmp_path):
    """`trainer.py --root --quick` (benchmarks/speed/trainer_root.py): the old root layout vs the FSDP2 units, 2 ranks
    a side; the keys and the units each side had, and equal losses (the layouts compute the same), not memory."""
    report, stdout = run_quick("speed/trainer_root.py", tmp_path, timeout=550)
    assert set(report["targets"]) == {"fsdp_root_units_rank_peak"}
    assert set(report["ratios"]) == {"fsdp_root_units_rank_peak", "fsdp_root_units_rank_peak_rss",
                                     "plan_root_units_rank_peak", "measured_vs_plan"}
    assert all(v > 0 for v in report["ratios"].values())
    before, after = report["results"]
    assert (before["name"], after["name"]) == ("before", "after")
    assert before["own_units"] == [False] * 3 and after["own_units"] == [True] * 3
    assert len(before["rank_step_peak_gib"]) == report["world"] == 2
    assert report["loss_max_abs_diff"] == 0.0 and report["plan"]["before_gib"] > report["plan"]["after_gib"]
    assert "fsdp_root_units_rank_peak" in stdout and "command: python benchmarks/speed/trainer.py --root" in stdout
