"""What every GPU stage shares: the sys.path for the benchmark modules, the stage's arguments, the device
record, device synchronisation for timing, and the output (one JSON per stage plus a markdown section).

What: a stage script calls `args = parse(doc)` and ends with `write(args.out, "b", report, markdown)`:
OUT/stage_b.json and a section appended to OUT/results.md (one markdown file for all stages, because a
GPU command brings back at most 8 files). `table(rows)` renders a markdown table.
Imported as a sibling module by benchmarks/gpu/stage_*.py (run as scripts).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # benchmarks/: common.py (which adds speed/: engine.py, trainer.py, ...)
import common  # noqa: E402

ROOT = HERE.parents[1]
PACK = ROOT / "gpu_pack"


def stage(doc: str, name: str, run, markdown, extra=None) -> dict:
    """A stage's main: its arguments (`parse`), `run(args)` timed, then `write` with `markdown(report)`."""
    args = parse(doc, extra)
    r = common.timed(run, args)
    write(args.out, name, r, markdown(r))
    return r


def parse(doc: str, extra=None) -> argparse.Namespace:
    """--device, --quick, --out DIR (default bench-results/gpu), --work DIR (scratch: models, runs)."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    common.add_device_arg(parser)
    parser.add_argument("--quick", action="store_true", help="Tiny sizes, same code path (the CPU smoke run).")
    parser.add_argument("--out", type=Path, default=ROOT / "bench-results" / "gpu", help="Where JSON + markdown go.")
    parser.add_argument("--work", type=Path, default=Path("/tmp/areal-gpu"), help="Scratch: models and runs.")
    if extra:
        extra(parser)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    args.work.mkdir(parents=True, exist_ok=True)
    return args


def cpu_smoke(args: argparse.Namespace) -> bool:
    """--quick on the CPU: CI's smoke run (`run.sh all --device cpu --quick`), where a stage runs the smallest thing
    that proves its code path (fewer runs, steps or repeats; issue 58). --quick on a GPU keeps its quick sizes."""
    return bool(args.quick) and str(args.device) == "cpu"


def machine(device: str) -> dict:
    return common.torch_machine(device=common.device_name(device))


def sync(device) -> None:
    """Wait for queued GPU work before reading a clock (a no-op on the CPU)."""
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def timer(device):
    """A clock that first waits for the device: `clock = timer(dev); t0 = clock(); ...; clock() - t0`."""
    def clock() -> float:
        sync(device)
        return time.perf_counter()

    return clock


def table(rows: list[tuple]) -> str:
    """Markdown table: the first row is the header."""
    lines = ["| " + " | ".join(str(c) for c in rows[0]) + " |", "|" + "---|" * len(rows[0])]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows[1:]]
    return "\n".join(lines)


def verdict(value: float | None, target: float, larger_is_better: bool = True) -> str:
    if value is None:
        return "-"
    return "met" if (value >= target if larger_is_better else value < target) else "NOT met"


def write(out: Path, stage: str, report: dict, markdown: str) -> None:
    """OUT/stage_<stage>.json and a '## Stage <stage>' section appended to OUT/results.md; prints the section."""
    report = {"stage": stage, **report}
    (out / f"stage_{stage}.json").write_text(json.dumps(report, indent=1))
    m = report.get("machine", {})
    head = f"## Stage {stage}: {report.get('title', '')}\n\ndevice: {m.get('device', '?')}, torch {m.get('torch', '?')}" \
           f", quick: {report.get('quick')}, wall {report.get('wall_s', '?')} s\n\n"
    with open(out / "results.md", "a") as f:
        f.write(head + markdown.rstrip() + "\n\n")
    print(head + markdown)
