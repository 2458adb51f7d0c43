"""`areal-mq plot`: the reward trend line and the PNG of a run directory (metrics + evals written by hand)."""
from __future__ import annotations

import json
import math

import pytest

from areal_mq.telemetry.plots import plot_run, rolling_mean, staleness_histogram


def test_rolling_mean_averages_the_last_values_and_skips_gaps():
    assert rolling_mean([1.0, 3.0, 5.0, 7.0], 2) == [1.0, 2.0, 4.0, 6.0]
    assert rolling_mean([None, 2.0, None, 4.0], 3) == [pytest.approx(math.nan, nan_ok=True), 2.0, 2.0, 3.0]


def test_plot_of_a_run_dir_is_written(tmp_path):
    with open(tmp_path / "metrics.jsonl", "w") as f:
        for v in range(1, 9):
            f.write(json.dumps({"version": v, "time": 100.0 + 30 * v, "reward_mean": 0.1 * (v % 3),
                                "staleness_mean": 1.5, "staleness_max": 2, "tokens_per_s": 70.0}) + "\n")
    with open(tmp_path / "eval.jsonl", "w") as f:
        f.write(json.dumps({"time": 100.0, "version": 0, "strict": 0.2, "lenient": 0.2}) + "\n")
        f.write(json.dumps({"time": 400.0, "version": 8, "strict": 0.35, "lenient": 0.36}) + "\n")
    png = plot_run(tmp_path)
    assert png.exists() and png.stat().st_size > 10_000


def test_empty_run_dir_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="no metrics.jsonl or eval.jsonl"):
        plot_run(tmp_path)


def test_staleness_histogram_sums_steps_of_different_lengths():
    steps = [{"staleness_hist": [4, 1]}, {"staleness_hist": [0, 2, 3]}, {"version": 3}]
    assert staleness_histogram(steps) == [4, 3, 3]
    assert staleness_histogram([{"staleness_mean": 1.0}]) == []


def test_plot_with_histograms_and_group_events(tmp_path):
    (tmp_path / "events").mkdir()
    with open(tmp_path / "metrics.jsonl", "w") as f:
        for v in range(1, 6):
            f.write(json.dumps({"version": v, "time": 100.0 + 30 * v, "reward_mean": 0.5, "staleness_hist": [3, 5, 9],
                                "tokens_per_s": 70.0}) + "\n")
    with open(tmp_path / "events" / "controller-controller.jsonl", "w") as f:
        for i in range(12):
            kind = "controller.group_dropped" if i % 3 else "controller.group_stored"
            f.write(json.dumps({"event": kind, "ts": 100.0 + 10 * i, "reward_mean": 0.1 * (i % 4)}) + "\n")
    assert plot_run(tmp_path).stat().st_size > 10_000
