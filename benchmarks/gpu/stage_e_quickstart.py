"""Stage e: configs/quickstart-gpu.yaml trained to v50, with held-out accuracy of the base model, v25 and v50.

What it measures: the whole system (`areal-mq run`: brokers, controller, rollout, reward and trainer processes,
trainer and engine on one device) on the real SmolLM2-135M-Instruct weights (the GGUF: they learn, random
weights would not; run.sh model-a / model-b bring it, docs/gpu.md). Reported: seconds of training from the
launcher's ready to v50, samples/s, reward first/last, and held-out strict/lenient accuracy (greedy, 200
problems) of base, v25 and v50 from run_dir/eval.jsonl.
Targets (issue 25): < 3 min of training to v50; held-out strict at v50 >= the CPU run's (45.0 %, README).
--quick: the tiny random Llama, 2 steps, 4 held-out problems (same code path, nothing is learnt).

    python benchmarks/gpu/stage_e_quickstart.py [--device cuda] [--quick] [--out DIR] [--work DIR]
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time

import report
from report import common

import e2e_report  # benchmarks/speed/e2e_report.py: summarize_run, version_time

CONFIG = report.ROOT / "configs" / "quickstart-gpu.yaml"
CPU_STRICT_V50 = 0.45  # README: the CPU quickstart's v50, 200 held-out problems, seed 0
TARGETS = {"train_s_to_last_version": 180.0, "heldout_strict_last": CPU_STRICT_V50}
QUICK = {"model.name": "tiny-random-llama", "model.dtype": "float32", "controller.total_steps": 2,
         "controller.batch_groups": 2, "controller.group_size": 2, "controller.max_new_tokens": 8,
         "controller.max_concurrent_groups": 4, "controller.drop_uniform_groups": False, "eval.every": 1,
         "eval.size": 4, "rollout.engine.max_concurrent": 8, "reward.processes": 1,
         "launcher.threads": '{"rollout": 1, "trainer": 1, "controller": 1, "reward": 1}'}
TIMEOUT_S = {True: 420, False: 560}
log = common.logger("gpu-e")


def overrides(args, run_dir) -> dict:
    job, bus_in, bus_out, store = common.free_ports(4)
    return {**(QUICK if args.quick else {}), "model.device": args.device, "run.run_dir": str(run_dir),
            "brokers.job_port": job, "brokers.bus_in_port": bus_in, "brokers.bus_out_port": bus_out,
            "brokers.store_port": store, "events.console": "json"}


def launch(args, run_dir, extra: dict | None = None) -> tuple[float, float]:
    """`areal-mq run` of the quickstart-gpu config (plus `extra` settings) into run_dir; (start time, wall s)."""
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    sets = {**overrides(args, run_dir), **(extra or {})}
    cmd = [sys.executable, "-m", "areal_mq.cli", "run", str(CONFIG), "--quiet",
           *[x for k, v in sets.items() for x in ("--set", f"{k}={v}")]]
    err_path = run_dir / "launcher.log"
    started, t0 = time.time(), time.monotonic()
    with open(err_path, "wb") as err:
        proc = subprocess.Popen(cmd, stdout=err, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                cwd=report.ROOT, env={**os.environ, "HF_HUB_OFFLINE": "1"}, start_new_session=True)
    try:
        proc.wait(TIMEOUT_S[args.quick])
    except subprocess.TimeoutExpired:
        log(f"run exceeded {TIMEOUT_S[args.quick]} s; stopping it (results so far are reported)")
    finally:
        common.stop_process(proc, signal.SIGINT, wait_s=60, kill_wait_s=10)
    if proc.returncode not in (0, -signal.SIGINT):
        tail = err_path.read_text(errors="replace")[-3000:]
        raise SystemExit(f"areal-mq run failed (exit {proc.returncode}); {err_path}:\n{tail}")
    return started, time.monotonic() - t0


def run(args) -> dict:
    from areal_mq.config import load_config
    from areal_mq.telemetry.plots import read_jsonl

    cfg = load_config(CONFIG, [f"{k}={v}" for k, v in overrides(args, args.work).items()])
    if not args.quick:
        from areal_mq.engines.models import gguf_path

        gguf_path()  # ModelNotFound with the fix when the GGUF was not delivered (run.sh model-a / model-b)
    run_dir = args.work / "quickstart-gpu"
    started, wall = launch(args, run_dir)
    summary = e2e_report.summarize_run(run_dir, started, wall)
    evals = {int(e["version"]): e for e in read_jsonl(run_dir / "eval.jsonl") if isinstance(e.get("version"), int)}
    last = cfg.controller.total_steps
    heldout = [{"version": v, "strict": e["strict"], "lenient": e["lenient"], "n": e["n"],
                "t": e2e_report.version_time(summary, v) if v in {p["version"] for p in summary["curve"]} or v == 0 else None}
               for v, e in sorted(evals.items())]
    train_s = e2e_report.version_time(summary, last) if summary["steps"] >= last else None
    ratios = {"train_s_to_last_version": train_s,
              "heldout_strict_last": evals[last]["strict"] if last in evals else None}
    keep = ("steps", "samples", "run_wall_s", "startup_s", "samples_per_s", "step_s_mean", "staleness_mean",
            "reward_first", "reward_last", "groups_dropped", "trainer_busy")
    return {"title": "quickstart-gpu to the last version", "quick": args.quick, "machine": report.machine(args.device),
            "model": cfg.model.name, "total_steps": last, "run": {k: summary[k] for k in keep},
            "heldout": heldout, "ratios": ratios, "targets": TARGETS}


def markdown(r: dict) -> str:
    rows = [("policy", "strict", "lenient", "n", "t (s after ready)")]
    rows += [("base" if h["version"] == 0 else f"v{h['version']}", f"{h['strict']:.1%}", f"{h['lenient']:.1%}", h["n"],
              "-" if h["t"] is None else f"{h['t']:.0f}") for h in r["heldout"]]
    t, s = r["ratios"]["train_s_to_last_version"], r["ratios"]["heldout_strict_last"]
    run = r["run"]
    return (report.table(rows) + f"\n\n{r['model']}: {run['steps']} steps, {run['samples']} samples, "
            f"{run['samples_per_s']:.2f} samples/s, reward {run['reward_first']:.2f} -> {run['reward_last']:.2f}; "
            f"training to v{r['total_steps']}: {'-' if t is None else f'{t:.0f} s'} (target < 180 s: "
            f"{report.verdict(t, 180.0, larger_is_better=False)}); held-out strict at the last version "
            f"{'-' if s is None else f'{s:.1%}'} (target >= the CPU run's 45.0 %: {report.verdict(s, CPU_STRICT_V50)})")


def main() -> None:
    report.stage(__doc__, "e", run, markdown)


if __name__ == "__main__":
    main()
