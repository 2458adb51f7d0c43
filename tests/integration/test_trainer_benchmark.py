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


def _trainer_long():
    import importlib
    import sys

    from .bench_smoke import ROOT

    sys.path.insert(0, str(ROOT / "benchmarks"))
    sys.path.insert(0, str(ROOT / "benchmarks" / "speed"))
    return importlib.import_module("trainer_long")


def test_long_ratios_carry_the_issues_names():
    """`trainer.py --long`'s ratios (issue 61 item 5): dense_vs_block_mask_peak_16k from the micro-batch peaks, the
    growth from 8k to the longest per attention; the dense path's skip is decided by its mask's 5 bytes a pair."""
    tl = _trainer_long()
    rows = [{"attention": a, "length": n, "mb_peak_gib": p, "seconds": s, "loss": -1e-6}
            for a, n, p, s in (("sdpa", 2048, 1.1, 10), ("varlen", 2048, 1.0, 10), ("sdpa", 8192, 2.0, 40),
                               ("varlen", 8192, 1.5, 40), ("sdpa", 16384, 4.0, 90), ("varlen", 16384, 2.0, 80),
                               ("varlen", 32768, 3.0, 200))]
    r = tl.ratios(rows)
    assert r["dense_vs_block_mask_peak_16k"] == 2.0 and r["dense_vs_block_mask_peak_2k"] == 1.1
    assert r["block_vs_dense_speed_16k"] == 1.125
    assert r["varlen_peak_growth_8k_to_32k"] == 2.0 and r["sdpa_peak_growth_8k_to_16k"] == 2.0
    assert "dense_vs_block_mask_peak_32k" not in r  # sdpa did not run at 32k: no ratio made up
    assert tl.mask_gib(16384) == 1.25 and tl.mask_gib(32768) == 5.0
    rows[0]["loss"] = -0.5  # the two attentions must train the same micro-batch to the same loss
    with pytest.raises(RuntimeError, match="losses differ"):
        tl.ratios(rows)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_long_gpu_stage_quick_on_the_cpu(tmp_path):
    """benchmarks/gpu/stage_h_long.py --device cpu --quick (run.sh h's code path; trainer_long's --quick sizes): both
    attentions at 512 and 1024 tokens, each in its own process, the peaks and ratios written."""
    import json
    import os
    import subprocess
    import sys

    from .bench_smoke import ROOT

    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks/gpu/stage_h_long.py"), "--device", "cpu", "--quick",
                           "--out", str(tmp_path / "out"), "--work", str(tmp_path / "work")], cwd=ROOT,
                          capture_output=True, text=True, timeout=560, stdin=subprocess.DEVNULL,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    r = json.loads((tmp_path / "out" / "stage_h.json").read_text())
    assert r["stage"] == "h" and [(x["length"], x["attention"]) for x in r["rows"]] == [
        (512, "sdpa"), (512, "varlen"), (1024, "sdpa"), (1024, "varlen")]
    assert all(0 < x["mb_peak_gib"] <= x["step_peak_gib"] + 0.05 for x in r["rows"])
    assert set(r["ratios"]) >= {"dense_vs_block_mask_peak_512", "dense_vs_block_mask_peak_1k", "block_vs_dense_speed_1k"}
    assert "need 2 or more" in r["parallel"]["why"]
    assert "## Stage h" in (tmp_path / "out" / "results.md").read_text()


@pytest.mark.timeout(300)
def test_trainer_recipes_benchmark_quick_runs(tmp_path):
    """`trainer.py --recipes --quick` (benchmarks/speed/trainer_recipes.py, issue 60): GRPO and every recipe of
    benchmarks/quality/quality.py train the same batch; REINFORCE++ alone builds a reference model; DAPO's
    sampling-side settings are named, not timed. Seconds on the tiny Llama."""
    import subprocess
    import sys

    from .bench_smoke import ROOT

    usage = subprocess.run([sys.executable, str(ROOT / "benchmarks/speed/trainer.py"), "--recipes", "--help"],
                           capture_output=True, text=True, timeout=60)
    assert usage.returncode == 0 and "recipe" in usage.stdout  # trainer.py hands --recipes to trainer_recipes.py
    report, stdout = run_quick("speed/trainer_recipes.py", tmp_path)
    setup, *rows = report["results"]
    names = [r["name"] for r in rows]
    assert names == ["grpo", "gspo", "drgrpo", "dapo", "reinforcepp", "rloo", "cispo"]
    assert set(report["ratios"]) == {f"{n}_vs_grpo_step_s" for n in names[1:]}
    assert all(v > 0 for v in report["ratios"].values())
    by = {r["name"]: r for r in rows}
    assert [n for n in names if by[n]["reference_model"]] == ["reinforcepp"]
    assert by["dapo"]["sampling_overrides"] and not by["gspo"]["sampling_overrides"]
    assert by["gspo"]["trainer_overrides"]["policy_loss"] == "gspo"
    assert all(len(r["step_s"]) == 1 for r in rows)
    assert "command: python benchmarks/speed/trainer.py --recipes --quick" in stdout
    bad = subprocess.run([sys.executable, str(ROOT / "benchmarks/speed/trainer_recipes.py"), "--quick",
                          "--only", "nosuch"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert bad.returncode != 0 and "unknown recipe" in bad.stderr
