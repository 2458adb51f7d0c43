"""benchmarks/quality/quality.py's defaults: a run of another length never overwrites the study's figure."""
from __future__ import annotations

import sys
from argparse import Namespace
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "benchmarks"), str(ROOT / "benchmarks" / "quality")]  # common.py; the quality study
import quality  # noqa: E402


def test_default_figure_is_one_per_run_length(tmp_path):
    study = Namespace(quick=False, versions=quality.STUDY_VERSIONS)
    assert quality.default_plot(study, tmp_path) == ROOT / "docs" / "quality.png"
    for versions in (40, 50, 150):
        path = quality.default_plot(Namespace(quick=False, versions=versions), tmp_path)
        assert path == ROOT / "docs" / f"quality_v{versions}.png"
    assert quality.default_plot(Namespace(quick=True, versions=50), tmp_path) == tmp_path / "quality.png"
    # levers alone (a recipe's run) draw under OUT; a study with a core mode keeps the docs/ figure
    lever = Namespace(quick=False, versions=50, modes=["dapo_eta2"])
    assert quality.default_plot(lever, tmp_path) == tmp_path / "quality_v50.png"
    both = Namespace(quick=False, versions=50, modes=["async_eta2", "dapo_eta2"])
    assert quality.default_plot(both, tmp_path) == ROOT / "docs" / "quality_v50.png"


def test_prune_keeps_only_the_final_weights_when_asked(tmp_path):
    for sub in ("weights/v49", "weights/v50", "checkpoints/step50", "eval_pins/v25"):
        (tmp_path / sub).mkdir(parents=True)
    (tmp_path / "metrics.jsonl").write_text("{}\n")
    quality.prune(tmp_path, keep_final=50)  # --keep-final
    assert sorted(p.name for p in (tmp_path / "weights").iterdir()) == ["v50"]
    assert not (tmp_path / "checkpoints").exists() and not (tmp_path / "eval_pins").exists()
    quality.prune(tmp_path)  # the default: the weights folder goes whole, the metrics stay
    assert not (tmp_path / "weights").exists() and (tmp_path / "metrics.jsonl").exists()


def test_the_recipe_report_pairs_each_recipe_with_grpo(tmp_path):
    """benchmarks/quality/recipes_report.py: v50 accuracy per seed, the gap to GRPO's same seed and to its mean over
    all its seeds; runs of another length, size or a mode that is no recipe are left out."""
    import recipes_report

    def run(mode, seed, strict, versions=50, eval_n=1100):
        return {"mode": mode, "seed": seed, "versions": versions, "eval_n": eval_n, "quick": False, "date": "d",
                "evals": [{"version": 0, "strict": 0.2, "t_s": 0.0}, {"version": versions, "strict": strict,
                                                                       "t_s": 20.0 * versions}],
                "per_step": {"entropy": [0.6, 0.1], "clip_frac": [0.0, 0.02]}}

    runs = [run("async_eta2", 0, 0.40), run("async_eta2", 1, 0.46), run("gspo_eta2", 0, 0.45),
            run("gspo_eta2", 1, 0.30), run("drgrpo_eta2", 0, 0.41, versions=20), run("sync", 0, 0.9),
            run("rloo_eta2", 0, 0.5, eval_n=200)]
    s = recipes_report.summary(runs, 50, 1100)
    assert set(s["modes"]) == {"async_eta2", "gspo_eta2"} and s["grpo_mean"] == 43.0
    gspo = s["modes"]["gspo_eta2"]
    assert gspo["strict_v50"] == {0: 45.0, 1: 30.0} and gspo["mean"] == 37.5
    assert gspo["gap_to_grpo_same_seed"] == [5.0, -16.0] and gspo["gap_to_grpo_mean"] == -5.5
    assert gspo["within_target"] is False  # 5.5 points below GRPO's mean: outside the ±5 target
    assert gspo["clip_frac_max"] == [0.02, 0.02] and gspo["s_per_version"] == [20.0, 20.0]
    assert "GSPO" in recipes_report.table(s, {"gspo_eta2": {"pass@1": 0.3, "pass@8": 0.6, "n": 200}})


def test_the_recipe_report_reads_passk_outputs_and_a_grpo_rerun(tmp_path):
    """recipes_report.py: `areal-mq eval --json` outputs named MODE-seedS.json average over seeds (base.json is the
    base model); an output of another size is refused, not averaged in; GRPO's rerun is its own row and dots."""
    import json

    import recipes_report

    def ev(p1, p8, n=200):
        return {"truncated": 0.1, "pass_at_k": {"n": n, "pass@k_strict": {"1": p1, "8": p8}}}

    folder = tmp_path / "passk"
    folder.mkdir()
    for name, body in {"base": ev(0.06, 0.26), "rloo_eta2-seed0": ev(0.40, 0.60), "rloo_eta2-seed1": ev(0.30, 0.70),
                       "grpo_rerun-seed0": ev(0.33, 0.55)}.items():
        (folder / f"{name}.json").write_text(json.dumps(body))
    pk = recipes_report.read_passk(folder)
    assert set(pk) == {"base", "rloo_eta2", "grpo_rerun"} and pk["rloo_eta2"]["seeds"] == [0, 1]
    assert abs(pk["rloo_eta2"]["pass@1"] - 0.35) < 1e-12 and abs(pk["rloo_eta2"]["pass@8"] - 0.65) < 1e-12
    assert recipes_report.read_passk(tmp_path / "absent") == {}

    def run(mode, seed, strict, versions=50):
        return {"mode": mode, "seed": seed, "versions": versions, "eval_n": 1100, "quick": False, "date": "d",
                "evals": [{"version": versions, "strict": strict, "t_s": 1000.0}],
                "per_step": {"entropy": [0.6, 0.1], "clip_frac": [0.0]}}

    s = recipes_report.summary([run("async_eta2", 0, 0.42), run("rloo_eta2", 0, 0.48)], 50, 1100)
    s["grpo_rerun"] = recipes_report.reruns([run("async_eta2", 0, 0.47), run("async_eta2", 1, 0.5, versions=20),
                                             run("rloo_eta2", 1, 0.9)], 50, 1100)
    assert s["grpo_rerun"] == {0: 47.0}
    s["passk"] = pk
    text = recipes_report.table(s, pk)
    assert "GRPO rerun on today's code" in text and "35.0 / 65.0 (n=200)" in text
    assert "6.0 / 26.0" in text and "33.0 / 55.0" in text
    assert recipes_report.plot(s, tmp_path / "r.png").stat().st_size > 0
    (folder / "rloo_eta2-seed2.json").write_text(json.dumps(ev(0.5, 0.8, n=100)))
    with pytest.raises(SystemExit, match="differ in size"):
        recipes_report.read_passk(folder)
