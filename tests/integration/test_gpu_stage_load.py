"""GPU stage l (benchmarks/gpu/stage_l_load.py: meta-device construction, sharded loading and one step of the 7B and
14B shapes on one GPU) smoke-run on the CPU at its quick size, so it runs the first time a GPU is lent."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_stage_l_quick_on_the_cpu(tmp_path):
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    done = subprocess.run([sys.executable, "benchmarks/gpu/stage_l_load.py", "--device", "cpu", "--quick", "--out",
                           str(tmp_path / "out"), "--work", str(tmp_path / "work")], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    report = json.loads((tmp_path / "out" / "stage_l.json").read_text())
    shape = report["shapes"]["tiny-qwen2"]
    assert shape["mode"] == "device" and shape["files"] > 1 and shape["loss"] == shape["loss"]  # a finite step
    assert shape["load_host_peak_gib"] > 0 and shape["plan_load_host_gib"] > 0
    assert "Stage l" in (tmp_path / "out" / "results.md").read_text()
    assert not (tmp_path / "work" / "load-tiny-qwen2").exists()  # the checkpoint is removed after its run
