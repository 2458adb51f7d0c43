"""End-to-end benchmark: synchronous vs asynchronous RL on the quickstart task, side by side in one run.

What it measures: the whole system (`areal-mq run configs/quickstart.yaml`: brokers, controller, rollout,
reward and trainer processes) runs in three modes (sync twice, see below) on the same model, the same 2 cores
and the same number of trained samples (total_steps x batch_groups x group_size sequences):
  - sync         run.mode=sync (generate a batch, reward it, train on it, repeat; η = 0),
  - async η=2    run.mode=async, controller.max_staleness=2,
  - async η=4    run.mode=async, controller.max_staleness=4.
Each mode gets its own best split of torch threads between processes (`launcher.threads`): sync gives
rollout and trainer 2 threads each because their phases alternate; async gives each 1 thread, because they run
at once and 3 busy OpenMP threads on 2 cores stall each other's kernels (measured 2026-11-22: async with
rollout 1 / trainer 2 made trainer steps 3-6x slower than alone and ran at 0.69x sync; 1 / 1 ran at 1.27x;
benchmarks/RESULTS.md). --async-threads / --sync-threads try other splits. For each run it reports whole-run wall time, samples/s over the training window (first to
last training step; see e2e_report.py for why) and held-out accuracy (strict and lenient, greedy, the same n
problems for every mode) evaluated after all runs on kept intermediate and final weights
(`trainer.keep_weight_versions` large; other versions and checkpoints are deleted after each run to bound
disk use). Headline ratio: `async_vs_sync_samples_per_s` (async η=2 over sync, larger is better, target 1.5);
η=4 is reported as `async_eta4_vs_sync_samples_per_s`. The machine is shared and its load drifts over the
hours a full run takes, so sync runs first AND last (sync, η=2, η=4, sync again) and the ratios divide by the
mean of the two sync rates: a load that rises or falls linearly over the run then cancels. One PNG overlays
accuracy and batch reward against wall time for every run.

    python benchmarks/speed/e2e.py [--quick] [--json PATH] [--out DIR] [--plot PNG] [--eval-n N]
                             [--eval-versions 12,24] [--keep-weights] [--reuse-runs] [--device cpu|cuda|cuda:N]
                             [--modes sync,async_eta2]

--device sets model.device for every role and the evaluations (default cpu; benchmarks/gpu/run.sh stage f).
--modes runs a subset of the four, in their order (at least one sync and one async; the ratios then divide by the
mean of the sync runs present and name only the async runs present). The CPU smoke of benchmarks/gpu stage f runs
`--quick --steps 2 --eval-versions 2 --modes sync,async_eta2`: η=4 and the second sync run the same code as those
two again (issue 58).

--quick runs the tiny random Llama for 3 steps per mode and evaluates its last two versions on 8 problems
(same code path, nothing is learnt). It cannot finish in 60 s: each `areal-mq run` spends ~25-35 s starting
its processes and ~10 s stopping them on 2 cores, so quick takes ~3 minutes (5 under a load average of 10).
The full benchmark (SmolLM2-135M-Instruct, 24 steps x 16 sequences per mode, 7 evaluations of 100
problems) takes hours on a shared 2-core machine: run it in the background with nohup. Each finished run
is saved to OUT/<mode>/bench_run.json; `--reuse-runs` picks those up (e.g. after an evaluation failed).
benchmarks/RESULTS.md records runs.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py (it adds the kinds' folders)
import common  # noqa: E402  (sibling modules of this script)
import e2e_report  # noqa: E402
from common import free_ports  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "quickstart.yaml"
TARGETS = {"async_vs_sync_samples_per_s": 1.5}
SYNC_THREADS = {"rollout": 2, "trainer": 2, "controller": 1, "reward": 1}
ASYNC_THREADS = {"rollout": 1, "trainer": 1, "controller": 1, "reward": 1}  # one core each (see the docstring)
MODES = [  # name, label, run.mode, η, threads per role; sync first and last (see the docstring)
    ("sync", "sync", "sync", 0, SYNC_THREADS),
    ("async_eta2", "async η=2", "async", 2, ASYNC_THREADS),
    ("async_eta4", "async η=4", "async", 4, ASYNC_THREADS),
    ("sync_repeat", "sync again", "sync", 0, SYNC_THREADS),
]
MODE_NAMES = [m[0] for m in MODES]
RATIO_NAMES = {"async_eta2": "async_vs_sync_samples_per_s", "async_eta4": "async_eta4_vs_sync_samples_per_s"}
QUICK = {"model.name": "tiny-random-llama", "controller.total_steps": 3, "controller.batch_groups": 2,
         "controller.group_size": 2, "controller.max_new_tokens": 16, "controller.max_concurrent_groups": 4,
         # the random model's answers all score alike: dropping uniform groups would starve the trainer
         "controller.drop_uniform_groups": False}
QUICK_EVAL_N = 8  # held-out problems per quick evaluation (full: the config's eval_size, 200)
RUN_TIMEOUT_S = {True: 600, False: 3 * 3600}


def threads_arg(text: str) -> dict[str, int]:
    """'rollout=1,trainer=1' -> {"rollout": 1, "trainer": 1} (roles: rollout, trainer, controller, reward)."""
    out = {}
    for part in filter(None, text.split(",")):
        role, _, n = part.partition("=")
        if role not in SYNC_THREADS or not n.isdigit() or int(n) < 1:
            raise argparse.ArgumentTypeError(f"{part!r}: expected ROLE=N with ROLE in {sorted(SYNC_THREADS)}, N >= 1")
        out[role] = int(n)
    return out


def modes_arg(text: str) -> list[str]:
    """'sync,async_eta2' -> those names in MODES order; at least one sync and one async run (the ratio needs both)."""
    names = [x for x in text.split(",") if x]
    unknown = [x for x in names if x not in MODE_NAMES]
    if unknown:
        raise argparse.ArgumentTypeError(f"{unknown}: expected names from {MODE_NAMES}")
    kinds = {m[2] for m in MODES if m[0] in names}
    if kinds != {"sync", "async"}:
        raise argparse.ArgumentTypeError(f"{names}: needs at least one sync and one async mode")
    return [n for n in MODE_NAMES if n in names]


def ratios(results: list[dict]) -> tuple[float, dict[str, float]]:
    """(the sync rate: the mean samples/s of the sync runs, first and last so that a linear drift in load cancels;
    each async run's samples/s over it, named by RATIO_NAMES)."""
    sync = [r["samples_per_s"] for r in results if r["mode"] == "sync"]
    rate = sum(sync) / len(sync)
    return rate, {RATIO_NAMES[r["name"]]: r["samples_per_s"] / rate for r in results if r["name"] in RATIO_NAMES}


log = common.logger("e2e")


def size_overrides(quick: bool, device: str = "cpu") -> dict:
    """Overrides shared by the runs and the evaluations (quick: the tiny model, fewer/shorter steps; device:
    model.device, so every role and the evaluation run there)."""
    return {**(QUICK if quick else {}), "model.device": device}


def run_overrides(mode: tuple, quick: bool, run_dir: Path, steps: int, device: str = "cpu") -> dict:
    _, _, run_mode, eta, threads = mode
    job, bus_in, bus_out, store = free_ports(4)
    keep_versions = steps + 1
    return {**size_overrides(quick, device), "controller.total_steps": steps, "run.run_dir": str(run_dir), "run.mode": run_mode,
            "controller.max_staleness": eta, "launcher.threads": json.dumps(threads),
            "trainer.keep_weight_versions": keep_versions, "brokers.job_port": job, "brokers.bus_in_port": bus_in,
            "brokers.bus_out_port": bus_out, "brokers.store_port": store, "events.console": "json"}


def count_lines(path: Path) -> int:
    try:
        with open(path, "rb") as f:
            return sum(1 for _ in f)
    except OSError:
        return 0


def launch(mode: tuple, quick: bool, run_dir: Path, total_steps: int, device: str = "cpu") -> dict:
    """One `areal-mq run` in a subprocess, with a step progress bar; returns timing and load figures."""
    from tqdm import tqdm

    if run_dir.exists():
        shutil.rmtree(run_dir)  # a leftover checkpoint would make the trainer resume instead of starting fresh
    run_dir.mkdir(parents=True)
    sets = run_overrides(mode, quick, run_dir, total_steps, device)
    cmd = [sys.executable, "-m", "areal_mq.cli", "run", str(CONFIG), "--skip-eval", "--quiet",
           *[x for k, v in sets.items() for x in ("--set", f"{k}={v}")]]
    err_path = run_dir / "launcher.stderr.log"
    loads: list[float] = []
    started_ts, t0 = time.time(), time.monotonic()
    with open(err_path, "wb") as err:
        proc = subprocess.Popen(cmd, stdout=err, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=ROOT,
                                env={**os.environ, "HF_HUB_OFFLINE": "1"}, start_new_session=True)
    try:
        with tqdm(total=total_steps, desc=f"{mode[1]} steps", unit="step", file=sys.stderr, leave=False) as bar:
            while not common.exited(proc, 0.5):  # returns as soon as the run ends; else samples the load every 0.5 s
                loads.append(os.getloadavg()[0])
                bar.update(min(total_steps, count_lines(run_dir / "metrics.jsonl")) - bar.n)
                if time.monotonic() - t0 > RUN_TIMEOUT_S[quick]:
                    raise TimeoutError(f"{mode[1]} run exceeded {RUN_TIMEOUT_S[quick]} s; see {err_path}")
    finally:
        stop(proc)
    wall = time.monotonic() - t0
    if proc.returncode != 0:
        tail = err_path.read_text(errors="replace")[-2000:]
        raise RuntimeError(f"{mode[1]} run failed (exit {proc.returncode}); launcher output ({err_path}):\n{tail}")
    return {"started_ts": started_ts, "wall_s": wall, "loadavg_during": sum(loads) / max(1, len(loads))}


def stop(proc: subprocess.Popen) -> None:
    """SIGINT lets the launcher checkpoint and stop its children. The launcher has its own session, so a
    Ctrl-C in the terminal reaches only this script, which then sends exactly one SIGINT."""
    common.stop_process(proc, signal.SIGINT, wait_s=90, kill_wait_s=10)


def prune(run_dir: Path, keep: set[int]) -> None:
    """Drop checkpoints and weight versions nobody will evaluate (~0.5 GB per SmolLM2 version)."""
    shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
    for d in (run_dir / "weights").glob("v*"):
        if d.name[1:].isdigit() and int(d.name[1:]) not in keep:
            shutil.rmtree(d, ignore_errors=True)


def eval_config(quick: bool, run_dir: Path, device: str = "cpu"):
    from areal_mq.config import load_config

    sets = {**size_overrides(quick, device), "run.run_dir": str(run_dir), "rollout.engine.threads": 2}
    return load_config(CONFIG, [f"{k}={v}" for k, v in sets.items()])


def evaluate_all(results: list[dict], versions: list[int], n: int, quick: bool, out: Path,
                 device: str = "cpu") -> dict:
    """Base model once (greedy: the same for every mode), then each mode's kept versions, same n problems."""
    from areal_mq.evaluation.heldout import base_eval_cached, evaluate

    cfg = eval_config(quick, out, device)  # the base model never changes: reuse its cached result when n is the config's
    base = base_eval_cached(cfg) if n == cfg.eval.size else evaluate(cfg, weights=None, n=n, version=0)
    log(f"base model: strict {base['strict']:.1%} lenient {base['lenient']:.1%} (n={base['n']}, {base['seconds']} s)")
    for r in results:
        r["evals"] = []
        for v in versions:
            e = evaluate(eval_config(quick, Path(r["run_dir"]), device), weights=str(Path(r["run_dir"]) / "weights" / f"v{v}"),
                         n=n, version=v)
            t = e2e_report.version_time(r, v)
            r["evals"].append({"version": v, "t": t, "strict": e["strict"], "lenient": e["lenient"], "n": e["n"],
                               "truncated": e["truncated"], "eval_s": e["seconds"]})
            log(f"{r['label']} v{v} (t={t:.0f} s): strict {e['strict']:.1%} lenient {e['lenient']:.1%}")
        r["final"] = r["evals"][-1]
    return {k: base[k] for k in ("n", "strict", "lenient", "truncated", "seconds", "version")}


def default_versions(steps: int, quick: bool) -> list[int]:
    """Full: a third, two thirds and the end of the run; quick: the last two versions (fewer evaluations)."""
    if quick:
        return sorted({max(1, steps - 1), steps})
    return sorted({max(1, round(steps * k / 3)) for k in (1, 2, 3)})


def run_mode(mode: tuple, args: argparse.Namespace, run_dir: Path, steps: int, versions: list[int]) -> dict:
    """Run one mode (or, with --reuse-runs, take its saved result when its weights are still there)."""
    saved = run_dir / "bench_run.json"
    if args.reuse_runs and saved.exists() and all((run_dir / "weights" / f"v{v}").is_dir() for v in versions):
        log(f"{mode[1]}: reusing {saved}")
        return json.loads(saved.read_text())
    timing = launch(mode, args.quick, run_dir, steps, args.device)
    summary = e2e_report.summarize_run(run_dir, timing["started_ts"], timing["wall_s"])
    prune(run_dir, set(versions))
    result = {"kind": "mode", "name": mode[0], "label": mode[1], "mode": mode[2], "eta": mode[3], "threads": mode[4],
              "run_dir": str(run_dir), **summary, "loadavg_during": timing["loadavg_during"]}
    saved.write_text(json.dumps(result, indent=1))
    log(f"{mode[1]}: {summary['samples']} samples, {summary['samples_per_s']:.3f} samples/s first->last step, "
        f"whole run {timing['wall_s']:.0f} s, load {timing['loadavg_during']:.1f}")
    return result


def run(args: argparse.Namespace) -> dict:
    from tqdm import tqdm

    from areal_mq.config import load_config

    cfg = load_config(CONFIG, [f"{k}={v}" for k, v in size_overrides(args.quick, args.device).items()])
    c = cfg.controller
    steps = args.steps or c.total_steps
    versions = args.eval_versions or default_versions(steps, args.quick)
    if max(versions) != steps or min(versions) < 1:
        raise SystemExit(f"--eval-versions {versions}: must lie in 1..{steps} and end with the final version {steps}")
    n = args.eval_n or (QUICK_EVAL_N if args.quick else cfg.eval.size)
    out = args.out or ROOT / "bench-results" / ("e2e-quick" if args.quick else "e2e")
    log(f"{cfg.model.name}: {steps} steps x {c.batch_groups} groups x {c.group_size} seqs per mode; "
        f"evaluating versions {versions} on n={n}; runs in {out}")
    modes = [(*m[:4], {**m[4], **(args.async_threads if m[2] == "async" else args.sync_threads)}) for m in MODES
             if m[0] in args.modes]
    results = [run_mode(mode, args, out / mode[0], steps, versions)
               for mode in tqdm(modes, desc="modes", unit="run", file=sys.stderr)]
    base = evaluate_all(results, versions, n, args.quick, out, args.device)
    if not args.keep_weights:
        for r in results:
            shutil.rmtree(Path(r["run_dir"]) / "weights", ignore_errors=True)
    plot_path = e2e_report.plot(results, base, args.plot or out / "accuracy_vs_time.png")
    sync_rate, by_async = ratios(results)
    setup = {"kind": "setup", "name": "setup", "model": cfg.model.name, "total_steps": steps,
             "batch_groups": c.batch_groups, "group_size": c.group_size, "max_new_tokens": c.max_new_tokens,
             "eval_n": n, "eval_versions": versions, "base": base, "plot": str(plot_path),
             "throughput_window": "first to last training step: samples of steps 2..N / (t_N - t_1)",
             "sync_samples_per_s_mean": sync_rate, "device": args.device}
    return {"benchmark": "e2e", "quick": args.quick, "machine": common.torch_machine(device=common.device_name(args.device)), "results": [setup, *results],
            "ratios": by_async, "targets": dict(TARGETS)}


def main() -> None:
    parser = common.arg_parser(__doc__, quick_help="Tiny model, 3 steps per mode (~3 min on 2 cores).")
    parser.add_argument("--out", type=Path, help="Where the run dirs go (default bench-results/e2e[-quick]).")
    parser.add_argument("--plot", type=Path, help="PNG path (default OUT/accuracy_vs_time.png).")
    parser.add_argument("--eval-n", type=int, help=f"Held-out problems per evaluation (default: the config's "
                                                   f"eval_size; quick: {QUICK_EVAL_N}).")
    parser.add_argument("--eval-versions", type=lambda s: [int(x) for x in s.split(",")],
                        help="Comma-separated versions to evaluate, ending with the last (default: thirds of the run).")
    parser.add_argument("--steps", type=int, help="Training steps per mode (default: the config's total_steps).")
    parser.add_argument("--keep-weights", action="store_true", help="Keep the evaluated weight versions on disk.")
    parser.add_argument("--async-threads", type=threads_arg, default={},
                        help=f"Thread split of the async modes, e.g. rollout=1,trainer=1 (default {ASYNC_THREADS}).")
    parser.add_argument("--sync-threads", type=threads_arg, default={},
                        help=f"Thread split of the sync modes (default {SYNC_THREADS}).")
    parser.add_argument("--reuse-runs", action="store_true", help="Reuse runs saved in OUT (evaluate only).")
    parser.add_argument("--modes", type=modes_arg, default=MODE_NAMES,
                        help=f"Comma-separated subset of {','.join(MODE_NAMES)} (default all; one sync and one async "
                             f"at least).")
    common.add_device_arg(parser)
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    report = common.timed(run, args)
    common.finish(report, args.json, e2e_report.table(report, common.command("e2e.py")))


if __name__ == "__main__":
    main()
