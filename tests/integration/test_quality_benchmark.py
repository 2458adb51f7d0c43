"""benchmarks/quality/quality.py --quick, then again: the study's code path stays alive and a rerun resumes.

Slow: two whole-system runs of the tiny config (sync and async η=2, 2 versions, seed 0, 8 held-out problems of
arith:test-large), then the same command again, which must skip both (nothing appended, no run started) and
report the same figures. Checks the JSON shape of BENCHMARKS.md, one results line per run with accuracy at each
evaluated version, per-step entropy / clipped / masked fractions, staleness within η and no violation. No
accuracy is asserted: the tiny random model learns nothing.
"""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from .bench_smoke import ROOT, run_quick

pytestmark = pytest.mark.slow


@pytest.mark.timeout(900)
def test_quick_study_writes_one_line_per_run_and_a_rerun_skips_them(tmp_path):
    results, png = tmp_path / "quality.jsonl", tmp_path / "quality.png"
    extra = ("--out", str(tmp_path / "runs"), "--results", str(results), "--plot", str(png))
    report, stdout = run_quick("quality/quality.py", tmp_path, *extra, timeout=800)

    assert set(report) >= {"benchmark", "quick", "machine", "results", "ratios", "targets"}
    setup, *modes = report["results"]
    assert setup["kind"] == "setup" and setup["eval_name"] == "arith:test-large" and setup["eval_n"] == 8
    assert sorted(m["mode"] for m in modes) == ["async_eta2", "sync"]
    assert set(report["ratios"]) <= set(report["targets"])
    async_mode = next(m for m in modes if m["mode"] == "async_eta2")
    assert async_mode["paired_vs_sync"]["n"] == 1 and async_mode["paired_vs_sync"]["ci95"] is None  # one seed
    lines = [json.loads(x) for x in results.read_text().splitlines()]
    assert sorted(x["mode"] for x in lines) == ["async_eta2", "sync"]
    for line in lines:
        versions = [e["version"] for e in line["evals"]]
        assert versions[0] == 0 and versions[-1] == 2 and versions == sorted(versions)
        assert all(e["n"] == 8 and 0 <= e["strict"] <= 1 for e in line["evals"])
        assert line["evals"][-1]["trained_samples"] == 2 * 2 * 2  # 2 versions x 2 groups x 2 sequences (tiny)
        assert [x for x in line["per_step"]["n_seqs"]] == [4, 4]
        for key in ("entropy", "clip_frac", "masked_frac", "staleness_max"):
            assert len(line["per_step"][key]) == 2 and all(v is not None for v in line["per_step"][key]), key
        assert max(line["per_step"]["staleness_max"]) <= line["eta"] and line["staleness_violations"] == 0
        run_dir = tmp_path / "runs" / f"{line['mode']}-seed0-v2"  # keyed by run length: a longer run keeps its own
        assert sum(line["staleness_hist"]) > 0 and (run_dir / "metrics.jsonl").exists()
        assert not (run_dir / "weights").exists()  # pruned
    assert png.stat().st_size > 10_000
    out = stdout.strip().splitlines()
    assert out[-2].startswith("command: python benchmarks/quality/quality.py --quick")

    again = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "quality" / "quality.py"), "--quick", *extra],
                           cwd=ROOT, capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
    assert again.returncode == 0, again.stderr[-3000:]
    assert again.stderr.count("done, skipped") == 2 and "versions" not in again.stderr  # no run started
    assert [json.loads(x) for x in results.read_text().splitlines()] == lines  # nothing appended

    plan = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "quality" / "quality.py"), "--quick", "--plan", *extra],
                          cwd=ROOT, capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert plan.returncode == 0 and "2 runs, 2 done" in plan.stdout and "0.0 h of machine time left" in plan.stdout
