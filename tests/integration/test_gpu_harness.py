"""`bash benchmarks/gpu/run.sh all --device cpu --quick` once, so the GPU harness cannot rot while no GPU is
around (issue 25 item 8; slow: it runs every stage, three whole-system runs included).

Stage f is `benchmarks/speed/e2e.py --quick --steps 2 --eval-versions 2 --modes sync,async_eta2` on the CPU: its
report is checked here against the JSON shape of BENCHMARKS.md (`check_e2e_report`). Two whole-system runs, not
four (issue 58: η=4 and the second sync run the same code again at ~30 s each), so the expected modes are
[sync, async_eta2] and the one ratio is async η=2 over sync; the ratio arithmetic over all four modes is checked
without processes in tests/unit/test_e2e_benchmark.py. Stage a on the CPU collects only the `gpu`-marked files.

Checks that every stage wrote its JSON and its section of results.md, the figures the docs and fit_sim.py read
are there, the cuda_ipc row is present (a TODO until it is built), and the fit of the simulator's slot loads.
No speed is asserted: on this CPU the sizes are tiny; the harness only keeps its code path alive. Also the
refusal paths of run.sh itself (an unknown stage or argument) which need no run.
"""
from __future__ import annotations

import json
import math
import os
import subprocess
from pathlib import Path

import pytest

from areal_mq.sim.timing import load_measured

ROOT = Path(__file__).resolve().parents[2]
RUN = ROOT / "benchmarks" / "gpu" / "run.sh"


def run_sh(*args: str, tmp: Path, timeout: float) -> subprocess.CompletedProcess:
    env = {**os.environ, "WORK": str(tmp / "work"), "PYTHON": os.environ.get("PYTHON", "python")}
    env.pop("OUT", None)
    return subprocess.run(["bash", str(RUN), *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


def test_unknown_stage_and_argument_are_refused(tmp_path):
    bad = run_sh("z", tmp=tmp_path, timeout=60)
    assert bad.returncode == 2 and "unknown stage 'z'" in bad.stderr
    bad = run_sh("b", "--gpu", tmp=tmp_path, timeout=60)
    assert bad.returncode == 2 and "unknown argument --gpu" in bad.stderr


@pytest.mark.slow
@pytest.mark.long  # ~2-3 min (121 s alone, issue 58): every GPU stage's code path once (tests/README.md)
@pytest.mark.timeout(2400)
def test_all_stages_quick_on_the_cpu(tmp_path):
    out = tmp_path / "out"
    done = run_sh("all", "--device", "cpu", "--quick", "--out", str(out), tmp=tmp_path, timeout=2300)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    stages = {s: json.loads((out / f"stage_{s}.json").read_text()) for s in "abcdefg"}
    assert all(r["stage"] == s and r["quick"] is True for s, r in stages.items())
    assert all(r["machine"]["device"] == "cpu" for r in stages.values())
    md = (out / "results.md").read_text()
    assert all(f"## Stage {s}:" in md for s in "abcdefg")
    g = stages["g"]  # the FSDP2 trainer vs the plain loop, per shape (tiny Qwen2 / Qwen3 on the CPU)
    assert all(r["runs"][k]["tokens_per_s"] > 0 for r in g["shapes"].values() for k in ("plain", "fsdp", "fsdp_ac"))

    assert stages["a"]["ratios"]["failed"] == 0
    gpu_suite = next(s for s in stages["a"]["suites"] if s["suite"] == "gpu")  # the marked files found, skipped here
    assert gpu_suite["skipped"] > 0 and "tests/unit/test_devices.py" in gpu_suite["selection"]
    b = stages["b"]
    assert [r["concurrency"] for r in b["longtail"]] == [4, 8]
    assert all(r["engine_tokens_per_s"] > 0 and r["hf_tokens_per_s"] > 0 for r in b["longtail"])
    assert len(b["decode_sweep"]) == 6 and b["prefill_tokens_per_s"] > 0
    assert [(c["shape"], c["batch"]) for c in b["ceiling"]] == [  # issue 42: decode step vs the bandwidth ceiling
        ("smollm2-135m", 1), ("smollm2-135m", 4), ("qwen2.5-1.5b", 1), ("qwen2.5-1.5b", 4)]
    assert all(c["step_s"] > 0 and c["ceiling_step_s"] is None for c in b["ceiling"])  # no HBM figure on a CPU
    assert set(stages["c"]["tokens_per_s"]) == {"trainer_shared", "trainer_dynamic", "plain"}
    modes = [u["mode"] for u in stages["d"]["updates"]]
    assert modes == ["disk", "zmq", "cuda_ipc"]
    assert all(u["engine_pause_s"] > 0 for u in stages["d"]["updates"][:2])
    e = stages["e"]
    assert e["run"]["steps"] == e["total_steps"] == 2
    assert [h["version"] for h in e["heldout"]][-1] == 2
    assert stages["f"]["benchmark"] == "e2e" and stages["f"]["quick"] is True
    check_e2e_report(stages["f"], out / "stage_f_accuracy.png")

    fit = load_measured(out / "sim_timing.json")
    assert fit.name == "smollm2-135m-quick-shape-cpu-measured"
    assert fit.decode_step_s(4, 32) > 0 and fit.update_pause_s > 0


def check_e2e_report(report: dict, png: Path) -> None:
    """benchmarks/speed/e2e.py's report: the JSON shape of BENCHMARKS.md, every run trained the same number of
    samples, each mode's staleness within its bound, evaluations and the plot produced, weights cleaned up. No speed
    is asserted (benchmarks measure speed; this keeps the code path alive)."""
    assert set(report) >= {"benchmark", "quick", "machine", "results", "ratios", "targets"}
    assert report["targets"] == {"async_vs_sync_samples_per_s": 1.5}
    assert set(report["ratios"]) == {"async_vs_sync_samples_per_s"}  # η=4 is not run on the CPU (docstring)
    assert all(math.isfinite(v) and v > 0 for v in report["ratios"].values())
    setup, *modes = report["results"]
    assert setup["kind"] == "setup" and setup["model"] == "tiny-random-llama"
    assert [m["name"] for m in modes] == ["sync", "async_eta2"]
    expected = setup["total_steps"] * setup["batch_groups"] * setup["group_size"]
    for m in modes:
        assert m["samples"] == expected, f"{m['name']} trained {m['samples']} samples, expected {expected}"
        assert m["steps"] == setup["total_steps"]
        assert m["staleness_max"] <= m["eta"]
        assert m["train_window_s"] > 0 and m["samples_per_s"] > 0
        assert [e["version"] for e in m["evals"]] == setup["eval_versions"]
        assert all(e["n"] == setup["eval_n"] and 0 <= e["strict"] <= 1 and 0 <= e["lenient"] <= 1 for e in m["evals"])
        assert m["final"]["version"] == setup["total_steps"]
        assert not (Path(m["run_dir"]) / "weights").exists(), "weights should be deleted without --keep-weights"
    assert {m["threads"]["rollout"] for m in modes} == {1, 2}
    assert setup["sync_samples_per_s_mean"] == pytest.approx(modes[0]["samples_per_s"])
    ratio = modes[1]["samples_per_s"] / modes[0]["samples_per_s"]
    assert report["ratios"]["async_vs_sync_samples_per_s"] == pytest.approx(ratio)
    assert png.stat().st_size > 10_000
