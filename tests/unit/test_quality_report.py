"""benchmarks/quality/quality_report.py's statistics on made-up runs, against numbers worked out by hand."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path[:0] = [str(Path(__file__).resolve().parents[2] / "benchmarks" / d) for d in ("", "quality")]
import quality_report as q  # noqa: E402

T975_2 = 4.302653  # t(0.975, 2 degrees of freedom)


def _run(mode, seed, finals, t_final=100.0, label=None):
    """A results line: evaluations at v0 (0.1), v10 and v20 (finals = (acc at v10, acc at v20))."""
    evals = [{"version": 0, "strict": 0.1, "trained_samples": 0, "t_s": 0.0},
             {"version": 10, "strict": finals[0], "trained_samples": 160, "t_s": t_final / 2},
             {"version": 20, "strict": finals[1], "trained_samples": 320, "t_s": t_final}]
    return {"mode": mode, "label": label or mode, "seed": seed, "evals": evals, "wall_s": t_final + 30,
            "versions": 20, "eval_name": "arith:test-large", "eval_n": 1100, "device": "cpu",
            "per_step": {"entropy": [0.6, 0.3], "clip_frac": [0.1, 0.2], "masked_frac": [0.0, 0.05],
                         "staleness_max": [0, 2]},
            "staleness_hist": [3, 2, 1], "staleness_violations": 0, "dropped_stale": seed}


def test_t_interval_by_hand():
    lo, hi = q.t_interval([0.02, 0.04, 0.0])  # mean 0.02, sd 0.02
    half = T975_2 * 0.02 / 3 ** 0.5
    assert (lo, hi) == pytest.approx((0.02 - half, 0.02 + half), rel=1e-6)
    assert q.t_interval([0.3]) is None


def test_accuracy_at_a_wall_time_is_interpolated_between_evaluations():
    run = _run("sync", 0, (0.3, 0.5), t_final=200.0)  # 0.1 at 0 s, 0.3 at 100 s, 0.5 at 200 s
    assert q.at_time(run, 0.0) == pytest.approx(0.1) and q.at_time(run, 50.0) == pytest.approx(0.2)
    assert q.at_time(run, 150.0) == pytest.approx(0.4) and q.at_time(run, 500.0) == pytest.approx(0.5)


def test_paired_differences_per_seed_and_at_equal_wall_time(tmp_path):
    runs = [_run("sync", s, (0.3, a), t_final=200.0) for s, a in enumerate((0.40, 0.50, 0.45))]
    runs += [_run("async_eta2", s, (0.35, a), t_final=100.0) for s, a in enumerate((0.42, 0.54, 0.45))]
    rep = q.report(runs, quick=False, plot_path=tmp_path / "q.png")
    setup, *modes = rep["results"]
    by = {m["mode"]: m for m in modes}
    pair = by["async_eta2"]["paired_vs_sync"]
    assert pair["diffs"] == pytest.approx([0.02, 0.04, 0.0]) and pair["mean"] == pytest.approx(0.02)
    assert pair["ci95"] == pytest.approx(q.t_interval([0.02, 0.04, 0.0]))
    # equal wall time = 100 s, the earliest final evaluation: async is at v20, sync at v10 (its t = 100 s)
    assert setup["equal_wall_time_s"] == 100.0
    assert by["async_eta2"]["paired_vs_sync_at_equal_wall_time"]["diffs"] == pytest.approx([0.12, 0.24, 0.15])
    assert by["sync"]["strict_mean"] == pytest.approx(0.45) and by["sync"]["strict_sd"] == pytest.approx(0.05)
    assert rep["ratios"]["async_eta2_vs_sync_strict"] == pytest.approx(0.47 / 0.45)
    assert rep["targets"]["async_eta2_vs_sync_strict"] == pytest.approx(0.43 / 0.45, abs=1e-4)
    # sync trains its 20 versions in 200 s, async in 100 s: a 2x speed-up, seed by seed
    assert rep["ratios"]["async_eta2_speedup_vs_sync_wall_time"] == pytest.approx(2.0)
    assert by["sync"]["train_s_mean"] == 200.0 and by["async_eta2"]["train_s_mean"] == 100.0
    assert by["sync"]["staleness_hist"] == [9, 6, 3] and by["sync"]["dropped_stale"] == 3
    assert (tmp_path / "q.png").stat().st_size > 10_000
    assert by["async_eta2"]["speedup_vs_sync"]["diffs"] == pytest.approx([2.0, 2.0, 2.0])
    table = q.table(rep, "python benchmarks/quality/quality.py")
    assert "+2.0 [" in table and " 2.00x " in table and " 1.7 " in table and table.splitlines()[-1] == "command: python benchmarks/quality/quality.py"


def test_a_mode_without_sync_seeds_is_not_paired(tmp_path):
    runs = [_run("sync", 0, (0.3, 0.4)), _run("cispo_eta4", 5, (0.3, 0.4))]
    by = {m.get("mode"): m for m in q.report(runs, quick=True, plot_path=tmp_path / "q.png")["results"]}
    assert by["cispo_eta4"]["paired_vs_sync"] is None and by["cispo_eta4"]["speedup_vs_sync"] is None


def test_async_eta1_gets_the_same_targets_as_the_default(tmp_path):
    runs = [_run("sync", s, (0.3, 0.40), t_final=200.0) for s in (0, 1)]
    runs += [_run("async_eta1", s, (0.3, 0.39), t_final=160.0) for s in (0, 1)]
    runs.append(_run("sync", 2, (0.3, 0.10), t_final=200.0))  # a seed η=1 lacks: not in its comparison
    rep = q.report(runs, quick=False, plot_path=tmp_path / "q.png")
    assert rep["ratios"]["async_eta1_vs_sync_strict"] == pytest.approx(0.39 / 0.40)
    assert rep["targets"]["async_eta1_vs_sync_strict"] == pytest.approx(0.38 / 0.40, abs=1e-4)
    assert rep["ratios"]["async_eta1_speedup_vs_sync_wall_time"] == pytest.approx(200 / 160)
    assert "async_eta2_vs_sync_strict" not in rep["ratios"]


def test_decoupled_over_naive_is_taken_over_the_seeds_both_have(tmp_path):
    runs = [_run("naive_eta4", s, (0.2, a)) for s, a in enumerate((0.28, 0.30, 0.10))]
    runs += [_run("async_eta4", s, (0.3, a)) for s, a in enumerate((0.35, 0.36))]
    rep = q.report(runs, quick=False, plot_path=tmp_path / "q.png")
    assert rep["ratios"]["decoupled_vs_naive_eta4_strict"] == pytest.approx(0.71 / 0.58)


def test_a_lever_with_a_sync_twin_is_paired_with_it_not_with_sync(tmp_path):
    runs = [_run("sync", s, (0.3, 0.40), t_final=200.0) for s in (0, 1)]
    runs += [_run("sync_small", s, (0.3, a), t_final=300.0) for s, a in ((0, 0.36), (1, 0.38))]
    runs += [_run("async_small", s, (0.3, a), t_final=150.0) for s, a in ((0, 0.35), (1, 0.38))]
    rep = q.report(runs, quick=False, plot_path=tmp_path / "q.png", bases={"async_small": "sync_small"})
    by = {m.get("mode"): m for m in rep["results"]}
    pair = by["async_small"]["paired_vs_sync"]
    assert pair["base"] == "sync_small" and pair["diffs"] == pytest.approx([-0.01, 0.0])
    assert by["sync_small"]["paired_vs_sync"]["base"] == "sync"  # the twin itself is still compared with sync
    assert rep["ratios"]["async_small_vs_sync_small_strict"] == pytest.approx(0.365 / 0.37)
    assert rep["targets"]["async_small_vs_sync_small_strict"] == pytest.approx(0.35 / 0.37, abs=1e-4)
    assert rep["ratios"]["async_small_speedup_vs_sync_small_wall_time"] == pytest.approx(2.0)
    assert "-0.5 [" in q.table(rep, "cmd") and "vs sync_small" in q.table(rep, "cmd")
