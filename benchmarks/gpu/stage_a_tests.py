"""Stage a: the fast test suite and the `gpu`-marked tests on this machine, counted.

What: pytest runs `-m "not slow"` over tests/ (full) and then `-m gpu` (skipped without CUDA), each writing
JUnit XML under --work; the counts (passed, failed, errors, skipped) and the first failing test ids go to
OUT/stage_a.json and results.md. The earlier H100 run had 21 failed / 398 passed (issue 25): the target is 0
failed. --quick runs only the `gpu`-marked tests and tests/unit/sim/test_fit_sim.py (the CPU smoke run must not
run the whole suite a second time inside CI); --quick on the CPU, where every `gpu` test skips, collects only the
files that carry the mark (found by reading tests/), not all of tests/ (~15 s of collection in CI, issue 58).

    python benchmarks/gpu/stage_a_tests.py [--device cuda] [--quick] [--out DIR]
"""
from __future__ import annotations

import subprocess
import sys
import xml.etree.ElementTree as ET

import report
from report import common

SUITES = {True: [("gpu", ["-m", "gpu", "tests"]), ("fit_sim", ["tests/unit/sim/test_fit_sim.py"])],
          False: [("fast", ["-m", "not slow", "tests"]), ("gpu", ["-m", "gpu", "tests"])]}
TIMEOUT_S = {True: 300, False: 420}
log = common.logger("gpu-a")


def gpu_marked_files() -> list[str]:
    """The test files that carry the `gpu` mark (a decorator, `pytestmark` or a param's marks), relative to the root."""
    tests = report.ROOT / "tests"
    return sorted(str(p.relative_to(report.ROOT)) for p in tests.rglob("test_*.py") if "mark.gpu" in p.read_text())


def selections(args) -> list[tuple[str, list[str]]]:
    if report.cpu_smoke(args):
        return [("gpu", ["-m", "gpu", *gpu_marked_files()]), *SUITES[True][1:]]
    return SUITES[args.quick]


def counts(xml_path) -> dict:
    out = {"tests": 0, "failed": 0, "errors": 0, "skipped": 0, "failures": []}
    if not xml_path.is_file():
        return out
    for case in ET.parse(xml_path).getroot().iter("testcase"):
        out["tests"] += 1
        kinds = {child.tag for child in case}
        name = f"{case.get('classname')}::{case.get('name')}"
        if "failure" in kinds or "error" in kinds:
            out["failed" if "failure" in kinds else "errors"] += 1
            out["failures"].append(name)
        elif "skipped" in kinds:
            out["skipped"] += 1
    out["passed"] = out["tests"] - out["failed"] - out["errors"] - out["skipped"]
    out["failures"] = out["failures"][:30]
    return out


def run(args) -> dict:
    suites = []
    for name, selection in selections(args):
        xml_path = args.work / f"junit_{name}.xml"
        xml_path.unlink(missing_ok=True)
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={xml_path}", *selection]
        log(" ".join(cmd[1:]))
        try:
            rc = subprocess.run(cmd, cwd=report.ROOT, timeout=TIMEOUT_S[args.quick]).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
        # pytest exit 5: nothing selected (no gpu-marked test in this tree) — a count of 0, not a failure
        suites.append({"suite": name, "selection": " ".join(selection), "exit": rc, **counts(xml_path)})
    failed = sum(s["failed"] + s["errors"] for s in suites) + sum(s["exit"] == "timeout" for s in suites)
    return {"title": "test suites", "quick": args.quick, "machine": report.machine(args.device), "suites": suites,
            "ratios": {"failed": failed}, "targets": {"failed": 0}}


def markdown(r: dict) -> str:
    rows = [("suite", "selection", "passed", "failed", "errors", "skipped", "exit")]
    rows += [(s["suite"], f"`{s['selection']}`", s["passed"], s["failed"], s["errors"], s["skipped"], s["exit"])
             for s in r["suites"]]
    fails = [f for s in r["suites"] for f in s["failures"]]
    return report.table(rows) + ("\n\nfailing: " + ", ".join(f"`{f}`" for f in fails) if fails else "\n\nno failures")


def main() -> None:
    r = report.stage(__doc__, "a", run, markdown)
    sys.exit(1 if r["ratios"]["failed"] else 0)


if __name__ == "__main__":
    main()
