"""`areal-mq plot`: the reward trend line and the PNG of a run directory (metrics + evals written by hand)."""
from __future__ import annotations

import json
import math

import pytest

from areal_mq.plots import plot_run, rolling_mean


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
