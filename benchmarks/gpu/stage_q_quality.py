"""Stage q: the quality study's sync vs async η=2 pairs, several seeds at once on one GPU machine (issue 27).

What it measures: benchmarks/quality/quality.py (configs/quickstart.yaml: same task, sizes, learning rate and length as
the CPU study; only `model.device` differs) for `--modes sync,async_eta2`, run by 2 x `--seeds-at-once` S
quality.py processes side by side: one per mode and slot, slot j running seeds j, j + S, ... in turn (so both
runs of a seed go at the same time and a round of S pairs ends together), each worker with its own results file
and run directories under WORK. Why side by side: one run of this 135M model leaves an H100/H200 mostly idle
(decode steps of a few ms are launch-bound) and the machine has 16 cores, so pairs per minute grow with workers
until the cores are busy; the CPU study's interval is too wide for want of seeds (~45 min a pair on 2 cores),
which is what this stage buys.
Equal trained samples is the study's comparison and is not touched by neighbours; wall time is (the runs share
the GPU and the cores), so the report's equal-wall-time figures from this stage are not the speed-up.
At `--deadline-s` the workers still running are interrupted (each stops its run; a run cut off records
nothing); the finished runs are merged into OUT/quality_gpu.jsonl, reported by benchmarks/quality/quality_report.py
(paired difference per seed, 95 % interval) into OUT/stage_q.json, OUT/results.md and OUT/quality_gpu.png, and
the worker logs and every run's launcher output go to OUT/q_logs.tar.gz.
Sizes on an H200 (2026-11-26, 8 runs side by side, 50 versions): async η=2 trains in 215-233 s and sync in
265-286 s, then each evaluates 1,100 problems in 55-60 s; start-up (install, GGUF conversion, the base model's
evaluation) is ~85 s. One round of 4 pairs therefore needs a deadline of ~400 s and fits one 10-minute command;
the first try gave 375 s and lost every sync run in its final evaluation.
--quick: configs/tiny.yaml, 2 versions, 8 problems, 1 seed at once (the code path on the CPU, nothing is learnt).

    python benchmarks/gpu/stage_q_quality.py [--device cuda] [--seeds-at-once 4] [--rounds 2] [--first-seed 0] \
        [--versions 50] [--eval-every 50] [--deadline-s 480] [--quick] [--out DIR] [--work DIR]
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import report
from report import common

import quality  # benchmarks/quality/quality.py: MODES, BASES, the study's settings
import quality_report

MODES = ("sync", "async_eta2")
log = common.logger("gpu-q")


def extra(parser) -> None:
    parser.add_argument("--seeds-at-once", type=int, help="Pairs side by side: 2 x this many quality.py processes "
                                                            "(default 4; quick 1).")
    parser.add_argument("--rounds", type=int, default=2, help="Seeds each worker runs in turn (default 2).")
    parser.add_argument("--first-seed", type=int, default=0, help="The seeds are first-seed, first-seed + 1, ...")
    parser.add_argument("--versions", type=int, help="Training steps per run (default 50, the quickstart's; quick 2).")
    parser.add_argument("--eval-every", type=int, help="Evaluate every N versions (default 50, as the CPU study "
                                                        "at 50 versions; quick 1).")
    parser.add_argument("--eval-n", type=int, help="Held-out problems per evaluation (default 1100; quick 8).")
    parser.add_argument("--deadline-s", type=float, help="Stop the workers this long after the first one started "
                                                        "(default 480; quick 900).")
    parser.add_argument("--stagger-s", type=float, default=4.0, help="Seconds between two workers' starts.")


def assignments(at_once: int, rounds: int, first: int) -> list[tuple[str, list[int]]]:
    """(mode, seeds) per worker: for each mode, slot j runs seeds first + j, first + j + S, ... (S = at_once), so
    the two runs of a seed go side by side and a deadline that cuts a round leaves the rounds before it whole."""
    if at_once < 1 or rounds < 1:
        raise ValueError(f"seeds at once and rounds must be >= 1 (got {at_once}, {rounds})")
    return [(mode, [first + j + k * at_once for k in range(rounds)]) for j in range(at_once) for mode in MODES]


def descendants(pid: int) -> list[int]:
    """Every live process below pid (from /proc: quality.py starts each run in a session of its own, so a
    process-group signal to the worker would miss it)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def worker_cmd(args, mode: str, seeds: list[int], wdir: Path) -> list[str]:
    cmd = [sys.executable, str(report.HERE.parent / "quality" / "quality.py"), "--device", args.device, "--modes", mode,
           "--seeds", ",".join(map(str, seeds)), "--versions", str(args.versions), "--eval-every", str(args.eval_every),
           "--eval-n", str(args.eval_n), "--results", str(wdir / "quality.jsonl"), "--out", str(wdir),
           "--plot", str(wdir / "quality.png"), "--json", str(wdir / "report.json")]
    return cmd + (["--quick"] if args.quick else [])


def stop_workers(procs: list[subprocess.Popen], wait_s: float = 60.0) -> None:
    """SIGINT each worker still running (quality.py then stops its run), then SIGKILL whatever is left below it."""
    tree = {p.pid: descendants(p.pid) for p in procs if p.poll() is None}
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGINT)
    end = time.monotonic() + wait_s
    for p in procs:
        try:
            p.wait(max(0.1, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    for pid, below in tree.items():
        for q in [pid, *below, *descendants(pid)]:
            try:
                os.kill(q, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
    for p in procs:
        try:
            p.wait(5)
        except subprocess.TimeoutExpired:
            log(f"worker {p.pid} did not exit after SIGKILL")


def prepare(args) -> None:
    """Build the model cache and evaluate the base model once before the workers start: each run would
    otherwise wait on the build lock, then evaluate the same base model as its neighbours at the same time."""
    from areal_mq.config import load_config
    from areal_mq.engines.models import resolve_model
    from areal_mq.evaluation.heldout import base_eval_cached

    sets = quality.overrides(MODES[0], args.first_seed, args, args.work / "quality-q" / "base")
    cfg = load_config(quality.QUICK_CONFIG if args.quick else quality.CONFIG, [f"{k}={v}" for k, v in sets.items()])
    log(f"model {cfg.model.name} ready at {resolve_model(cfg.model.name, cfg.model.cache_dir)}")
    base = base_eval_cached(cfg, progress=False)
    log(f"base model: strict {base['strict']:.1%} on {base['n']} problems ({'cached' if base.get('cached') else 'measured'})")


def run(args) -> dict:
    prepare(args)
    plan = assignments(args.seeds_at_once, args.rounds, args.first_seed)
    root = args.work / "quality-q"
    procs, t0 = [], time.monotonic()
    for w, (mode, ws) in enumerate(plan):
        wdir = root / f"w{w}"
        wdir.mkdir(parents=True, exist_ok=True)
        (wdir / "quality.jsonl").unlink(missing_ok=True)  # a fresh study each time: results come back in OUT
        out = open(wdir / "worker.log", "wb")
        procs.append(subprocess.Popen(worker_cmd(args, mode, ws, wdir), stdout=out, stderr=subprocess.STDOUT,
                                      stdin=subprocess.DEVNULL, cwd=report.ROOT,
                                      env={**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}))
        log(f"worker {w}: {mode} seeds {ws} (pid {procs[-1].pid})")
        time.sleep(args.stagger_s)
    while any(p.poll() is None for p in procs) and time.monotonic() - t0 < args.deadline_s:
        time.sleep(2.0)
    cut = [w for w, p in enumerate(procs) if p.poll() is None]
    if cut:
        log(f"deadline {args.deadline_s:.0f} s: stopping workers {cut}")
        stop_workers(procs)
    lines = [line for w in range(len(plan)) for line in quality_report.read_jsonl(root / f"w{w}" / "quality.jsonl")]
    with open(args.out / "quality_gpu.jsonl", "w") as f:
        f.writelines(json.dumps(line) + "\n" for line in lines)
    with tarfile.open(args.out / "q_logs.tar.gz", "w:gz") as tar:  # worker logs and each run's launcher output
        for path in sorted(root.glob("w*/worker.log")) + sorted(root.glob("w*/*/launcher.stderr.log")):
            tar.add(path, arcname=str(path.relative_to(root)))
    workers = [{"mode": mode, "seeds": ws, "exit": procs[w].returncode, "cut_at_deadline": w in cut,
                "runs_done": sum(1 for line in lines if line["mode"] == mode and line["seed"] in ws)}
               for w, (mode, ws) in enumerate(plan)]
    out = {"title": "quality study pairs side by side (sync vs async η=2)", "quick": args.quick,
           "machine": report.machine(args.device), "versions": args.versions, "eval_n": args.eval_n,
           "eval_every": args.eval_every, "workers": workers, "runs": len(lines)}
    if lines:
        study = quality_report.report(lines, args.quick, args.out / "quality_gpu.png", quality.BASES)
        out["report"] = study
        out["table"] = quality_report.table(study, "benchmarks/gpu/stage_q_quality.py")
    return out


def markdown(r: dict) -> str:
    rows = [("worker", "mode", "seeds", "runs done", "exit", "cut at deadline")]
    rows += [(w, x["mode"], ",".join(map(str, x["seeds"])), x["runs_done"], x["exit"], x["cut_at_deadline"])
             for w, x in enumerate(r["workers"])]
    return report.table(rows) + f"\n\n{r['runs']} runs finished, {r['versions']} versions each, " \
                                f"{r['eval_n']} held-out problems\n\n" + r.get("table", "(no finished run)")


def main() -> None:
    args = report.parse(__doc__, extra)
    pick = lambda given, quick, full: given if given is not None else quick if args.quick else full  # noqa: E731
    args.seeds_at_once = pick(args.seeds_at_once, 1, 4)
    args.versions = pick(args.versions, quality.QUICK_VERSIONS, 50)
    args.eval_every = pick(args.eval_every, 1, 50)
    args.eval_n = pick(args.eval_n, quality.QUICK_EVAL_N, 1100)
    args.deadline_s = pick(args.deadline_s, 900.0, 480.0)
    r = common.timed(run, args)
    report.write(args.out, "q", r, markdown(r))


if __name__ == "__main__":
    main()
