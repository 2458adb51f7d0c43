"""GPU stage p (benchmarks/gpu/stage_p_precision.py: the quickstart-gpu config under the bf16/bf16, fp16/fp16 and
bf16/fp32 engine/trainer pairs, side by side) runs first time: its --device cpu --quick smoke, through run.sh as a
lent GPU would run it, writes every pair's held-out results (base and v2: the CPU smoke runs no periodic evaluation,
stage e's covers it) and per-step mismatch_kl. No accuracy is asserted."""
from __future__ import annotations

import json

import pytest

from .test_gpu_harness import run_sh


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_stage_p_quick_on_the_cpu(tmp_path):
    done = run_sh("p", "--device", "cpu", "--quick", "--out", str(tmp_path / "out"), tmp=tmp_path, timeout=850)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((tmp_path / "out" / "stage_p.json").read_text())
    assert set(report["pairs"]) == {"bf16/bf16", "fp16/fp16", "bf16/fp32"}
    for name, pair in report["pairs"].items():
        assert "error" not in pair, (name, pair.get("error"))
        assert pair["mismatch_kl"] and pair["mismatch_kl_mean"] >= 0, name
        assert {"0", "2"} <= set(map(str, pair["heldout"])), pair["heldout"]
