"""benchmarks/speed/e2e.py's arithmetic without its whole-system runs: which modes `--modes` picks and the ratios
over the mean of the sync runs, for all four modes (the GPU's run) and for the two that CI's CPU smoke runs
(tests/integration/test_gpu_harness.py starts those two for real)."""
from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

import pytest

SPEED = Path(__file__).resolve().parents[2] / "benchmarks" / "speed"


@pytest.fixture(scope="module")
def e2e():
    sys.path.insert(0, str(SPEED))  # e2e.py then adds benchmarks/ (common.py)
    try:
        yield importlib.import_module("e2e")
    finally:
        sys.path.remove(str(SPEED))


def run(name: str, mode: str, rate: float) -> dict:
    return {"name": name, "mode": mode, "samples_per_s": rate}


def test_all_four_modes_divide_by_the_mean_of_both_sync_runs(e2e):
    results = [run("sync", "sync", 1.0), run("async_eta2", "async", 3.0), run("async_eta4", "async", 4.5),
               run("sync_repeat", "sync", 2.0)]
    rate, ratios = e2e.ratios(results)
    assert rate == pytest.approx(1.5)
    assert ratios == {"async_vs_sync_samples_per_s": pytest.approx(2.0),
                      "async_eta4_vs_sync_samples_per_s": pytest.approx(3.0)}
    assert set(e2e.TARGETS) <= set(ratios)


def test_two_modes_give_the_headline_ratio_over_the_one_sync_run(e2e):
    rate, ratios = e2e.ratios([run("sync", "sync", 2.0), run("async_eta2", "async", 3.0)])
    assert rate == 2.0 and ratios == {"async_vs_sync_samples_per_s": pytest.approx(1.5)}


def test_modes_keep_the_benchmark_order_and_need_a_sync_and_an_async_run(e2e):
    assert e2e.modes_arg("async_eta2,sync") == ["sync", "async_eta2"]
    assert e2e.modes_arg(",".join(e2e.MODE_NAMES)) == [m[0] for m in e2e.MODES]
    with pytest.raises(argparse.ArgumentTypeError, match="expected names"):
        e2e.modes_arg("sync,async")
    with pytest.raises(argparse.ArgumentTypeError, match="one sync and one async"):
        e2e.modes_arg("sync,sync_repeat")
