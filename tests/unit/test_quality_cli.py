"""benchmarks/quality/quality.py's defaults: a run of another length never overwrites the study's figure."""
from __future__ import annotations

import sys
from argparse import Namespace
from pathlib import Path

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
