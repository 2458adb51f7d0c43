"""The shared start of every benchmark smoke test: run one script of benchmarks/ in --quick mode, once.

Why: a benchmark that no test runs rots; these tests keep the code path and the documented JSON shape
(benchmarks/BENCHMARKS.md) alive without asserting a speed. Used by tests/integration/test_*_benchmark.py
and tests/unit/engines/test_engine_benchmark.py.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_quick(script: str, tmp_path: Path, *extra: str, timeout: float = 600) -> tuple[dict, str]:
    """`python benchmarks/SCRIPT --quick --json TMP/NAME.json EXTRA...` from the repository root (hub offline).

    Asserts it exited 0 (showing the end of its stderr if not) and that the JSON names the benchmark and
    quick mode; returns the report and the printed table (stdout).
    """
    name = Path(script).stem
    out = tmp_path / f"{name}.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), "--quick", "--json", str(out), *extra],
                          cwd=ROOT, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(out.read_text())
    assert report["benchmark"] == name and report["quick"] is True
    return report, proc.stdout
