"""Every file in configs/ rehearsed end to end (`areal-mq run CONFIG --rehearse`), and what a rehearsal refuses.

The configs are globbed, so a config added later is rehearsed without anyone remembering to (STYLE 21: a config we
ship is a config we ran). Each rehearsal starts every process its layout asks for (the 7B layout: 8 trainer
ranks over gloo, 8 engines, 4 reward workers, under a local Ray with pretend GPUs), kills one trainer rank after
the first checkpoint and checks the resume; a tiny model and 4 steps keep the whole folder to a few minutes on 2
cores. Run: pytest tests/integration/test_rehearsal.py -m slow
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))


def rehearse(config: Path | str, run_dir: Path, *extra: str, timeout: float = 600) -> tuple[subprocess.CompletedProcess, dict]:
    proc = subprocess.run([sys.executable, "-m", "areal_mq.cli", "run", str(config), "--rehearse", "--quiet",
                           "--set", f"run.run_dir={run_dir}", *extra], capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL, cwd=str(run_dir.parent),
                          env={**os.environ, "PYTHONUNBUFFERED": "1"})
    report_path = run_dir.with_name(run_dir.name + "-rehearsal") / "rehearsal.json"
    return proc, (json.loads(report_path.read_text()) if report_path.is_file() else {})


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: p.name)
def test_every_shipped_config_rehearses_green(config, tmp_path):
    from areal_mq.config import load_config
    from areal_mq.launch.rehearsal import expected_processes

    cfg = load_config(config)
    proc, report = rehearse(config, tmp_path / "run")
    tail = (proc.stdout + proc.stderr)[-4000:]
    assert proc.returncode == 0 and report.get("ok"), tail
    for role, want in expected_processes(cfg).items():  # every process the layout asks for, alive at the end
        assert report["roles"][role]["alive_at_end"] == want, (role, report["roles"])
    killed = report["resume"]["killed"]
    assert killed and killed["checkpoints"] and report["resume"]["resumed"], report["resume"]
    assert killed["rank"] == cfg.launcher.trainer_ranks - 1  # the last rank: a non-zero one where there are several
    assert sorted(report["engines"]) == [f"rollout-{i}" for i in range(cfg.launcher.rollout_workers)]
    versions = [e["version"] for e in report["evaluations"]]
    assert versions[0] == 0 and versions[-1] == report["steps"]
    assert report["plan"]["occupancy"]["occupancy"] >= 0.9 and not report["plan"]["refusals"]
    if any(getattr(cfg.placement, r).gpus for r in ("trainer", "rollout")):  # pretend devices, as placed
        assert report["roles"]["rollout"]["cuda_visible_devices"], report["roles"]


@pytest.mark.slow
def test_a_layout_without_a_held_out_set_fails_naming_the_field(tmp_path):
    """The node configs' first failure (issue 50): no data.eval_name with a local dataset. One line, the field,
    exit 1, a report; no process is started."""
    from areal_mq.data.samples import SAMPLES

    proc, report = rehearse(ROOT / "configs" / "tiny.yaml", tmp_path / "run", "--set",
                            f"data.name={SAMPLES['gsm8k'][0]}", timeout=300)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert not report["ok"] and report["failures"][0]["field"] == "data.eval_name", report["failures"]
    assert "Traceback" not in proc.stderr and report["roles"] == {}
