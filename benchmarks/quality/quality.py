"""Quality study: does async learn as well as sync? Held-out accuracy over seeds, at equal trained samples.

What it measures (issue 27 item 2): `areal-mq run configs/quickstart.yaml` in each mode below, with the same
number of training steps (`--versions`, default 20, the study's length; every mode trains the same samples per
step) and per seed (the seed of the data order, data.seed; of sampling and init, run.seed; of the trainer's
RNGs, trainer.seed):
  - sync            run.mode=sync (η = 0)                                   core: seeds 0,1,2
  - async_eta2      async, η=2, decoupled PPO (the default)                 core: seeds 0,1,2
  - naive_eta4      async, η=4, correction off (naive PPO, the paper's ablation)   core: seeds 0,1,2
  - async_eta4      async, η=4, decoupled PPO                               --extra-seeds (default 3)
  - tis_eta4 / icepop_eta4 / cispo_eta4: async η=4 with each off-policy correction of the loss
    (trainer.behav_weight_cap=2 truncate; trainer.offpolicy_mask_k=2; trainer.policy_loss=cispo)  --extra-seeds
Each run evaluates strict held-out accuracy, greedy, on `--eval-n` problems of arith:test-large (1,100) at
version 0 (the base model), every `--eval-every` versions (in the background, areal_mq/evaluation/periodic.py:
on a busy machine it may skip a version and evaluate a later one) and at the end.
Every finished run appends ONE JSON line to the results file (benchmarks/results/quality.jsonl): accuracy at
each evaluated version with trained samples and wall time (counted from when every process was ready: the
base model's evaluation before training is cached, so it would favour later runs), entropy, clipped
and masked fractions and staleness per step, the staleness histogram, the invariant counters. A rerun skips the runs already there (resumable; a
run that was cut off is started again from scratch). The report (benchmarks/quality/quality_report.py) gives per-mode
means, the PAIRED difference to sync per seed with a 95 % t-interval, accuracy at equal wall time, one figure
(accuracy vs trained samples and vs wall time: docs/quality.png for the study's 20 versions, docs/quality_vN.png
for any other --versions N, so a longer run never overwrites the study's figure) and the table, printed last.

    python benchmarks/quality/quality.py --plan                 # the runs, which are done, an estimate of machine time
    python benchmarks/quality/quality.py [--versions 20] [--eval-every 10] [--modes sync,async_eta2] [--seeds 0,1]
                                 [--extra-seeds 3] [--device cpu|cuda] [--json PATH] [--plot PNG]
    python benchmarks/quality/quality.py --report-only          # report what the results file holds
    python benchmarks/quality/quality.py --quick                # configs/tiny.yaml, 2 versions, 1 seed, sync + async η=2

Entropy on a longer run (item 4): the quickstart's async η=2 for 150 versions, evaluated every 25, in its own
results file and figure; then, if accuracy falls as entropy collapses, the same with a lever (LEVERS below):
    python benchmarks/quality/quality.py --versions 150 --eval-every 25 --eval-n 500 --modes async_eta2 --seeds 0 \
        --results benchmarks/results/entropy.jsonl --plot docs/entropy.png
    ... --modes async_eta2,cliphigher_eta2 ...          # before/after on one figure

The full study takes many hours (each quickstart version is ~20 s of CPU training, each evaluation of 1,100
problems minutes): run it in the background with nohup, commit the results file as it grows.
--quick (~3 minutes on 2 cores) writes under bench-results/quality-quick/ and checks the code path only.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py (it adds the kinds' folders)
import common  # noqa: E402  (sibling modules of this script)
import quality_report  # noqa: E402
from common import free_ports  # noqa: E402
from e2e import ASYNC_THREADS, SYNC_THREADS, count_lines, stop  # noqa: E402
from e2e_report import ready_time  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
CONFIG, QUICK_CONFIG = ROOT / "configs" / "quickstart.yaml", ROOT / "configs" / "tiny.yaml"
RESULTS = ROOT / "benchmarks" / "results" / "quality.jsonl"
STUDY_VERSIONS = 20  # the study's run length (RESULTS.md); its figure is docs/quality.png
EVAL_NAME = "arith:test-large"
CORE_SEEDS = (0, 1, 2)
# name -> (label, run.mode, η, trainer overrides, core)
MODES = {
    "sync": ("sync", "sync", 0, {}, True),
    "async_eta2": ("async η=2", "async", 2, {}, True),
    "naive_eta4": ("async η=4 naive", "async", 4,
                   {"trainer.behav_correction": False, "trainer.allow_uncorrected_off_policy": True}, True),
    "async_eta4": ("async η=4", "async", 4, {}, False),
    "tis_eta4": ("async η=4 TIS C=2", "async", 4, {"trainer.behav_weight_cap": 2.0, "trainer.behav_cap_mode": "truncate"},
                 False),
    "icepop_eta4": ("async η=4 IcePop k=2", "async", 4, {"trainer.offpolicy_mask_k": 2.0}, False),
    "cispo_eta4": ("async η=4 CISPO", "async", 4, {"trainer.policy_loss": "cispo"}, False),
}
# Levers, run on request (--modes) and not part of the default study. Against an entropy collapse (issue 27
# item 4): clip-higher (DAPO, arXiv 2503.14476: a wider upper clip lets unlikely tokens gain probability) and a
# learning rate that decays after warm-up (cosine to 10 % over 150 steps).
SMALL_STEPS = {"trainer.lr": 5e-6, "controller.batch_groups": 2, "controller.max_concurrent_groups": 4}
LEVERS = {
    # async η=2 below sync at equal samples (2 seeds, RESULTS.md): is it the staleness? η=1 halves the bound
    "async_eta1": ("async η=1", "async", 1, {}, False),
    # the control for that question: sync's loop (η=0 is what run.mode=sync sets) with async's one thread per
    # process, so the ONLY difference to `sync` is the thread count; if it is below sync too, staleness is not
    # the cause
    "async_eta0": ("async η=0 (sync loop, async threads)", "async", 0, {}, False),
    # what switches on with η >= 1 is (a) samples a version or two old and (b) sequences interrupted by an update,
    # so that one sequence spans two versions; this lever keeps (a) and removes (b): every sequence has one version
    "nointr_eta2": ("async η=2 non-interruptible", "async", 2, {"rollout.interruptible": False}, False),
    # the deficit is not the interruptions (nointr_eta2) and barely grows with η: a token's own weight corrects
    # the token the stale policy sampled, not the prefix it sampled it in; the sequence's weight corrects both
    "seqis_eta2": ("async η=2 sequence-level weights (cap 5)", "async", 2, {"trainer.behav_weight_level": "sequence"},
                   False),
    # is the deficit the policy moving far in one version (max behaviour weight ~2 after one version)? sync and
    # async η=2 at half the learning rate, compared with each other
    "sync_lr5e-6": ("sync lr 5e-6", "sync", 0, {"trainer.lr": 5e-6}, False),
    "async_lr5e-6": ("async η=2 lr 5e-6", "async", 2, {"trainer.lr": 5e-6}, False),
    # the same 320 samples and the same total movement (each version is one clipped Adam step, so a version moves
    # the policy about lr) in steps half as long: 40 versions of 8 sequences at lr 5e-6, 4 groups in flight so a
    # sample's age in versions stays as at 16 a batch. If the cost of a stale sample grows with how far one
    # version moves the policy, async should close in on sync here (run with --versions 40 --eval-every 40)
    "sync_small": ("sync, 40 × 8 at lr 5e-6", "sync", 0, SMALL_STEPS, False),
    "async_small": ("async η=2, 40 × 8 at lr 5e-6", "async", 2, SMALL_STEPS, False),
    # completion-time selection: async fills each batch with the groups that FINISH first (short answers), sync
    # with the groups it admitted; this lever makes async put groups in admission order (controller.batch_order)
    "ordered_eta2": ("async η=2, batches in admission order", "async", 2, {"controller.batch_order": "admission"},
                     False),
    "cliphigher_eta2": ("async η=2 clip-higher ε_high=0.28", "async", 2, {"trainer.eps_clip_high": 0.28}, False),
    # a GPU run (benchmarks/gpu/stage_q_quality.py, RESULTS.md) learnt far less than the CPU and its behaviour
    # weights grew to ~100 at staleness 0: there `trainer.precision: auto` meant bf16 autocast against an fp32
    # engine. These run the CPU study with the trainer in bf16 autocast, the GPU's numerics on this machine
    "bf16_eta2": ("async η=2, trainer bf16 autocast", "async", 2, {"trainer.precision": "bf16"}, False),
    "sync_bf16": ("sync, trainer bf16 autocast", "sync", 0, {"trainer.precision": "bf16"}, False),
    # configs/quickstart-gpu.yaml's numerics: engine AND trainer in bf16 (model.dtype; precision auto follows it)
    "sync_bf16both": ("sync, engine and trainer bf16", "sync", 0, {"model.dtype": "bfloat16"}, False),
    # issue 38: weights reach the workers over zmq as verified deltas (the quickstart publishes full versions on
    # disk); the weights are bit-identical, so only the timing of updates differs. Compared with async_eta2
    "zmq_deltas_eta2": ("async η=2, weights as zmq deltas", "async", 2, {"trainer.publish_mode": "zmq"}, False),
    # issue 53: a LoRA policy (trainer.lora rank 16, alpha 32, every linear layer; the base frozen) at the
    # quickstart's settings otherwise, against full fine-tuning's async η=2. LoRA needs a larger learning rate
    # than full fine-tuning (its update is alpha/rank * B @ A with B starting at zero); these find it
    **{f"lora_eta2_lr{lr}": (f"async η=2 LoRA r16 lr {lr}", "async", 2,
                             {"trainer.lora.rank": 16, "trainer.lora.alpha": 32.0, "trainer.lr": float(lr)}, False)
       for lr in ("5e-5", "1e-4", "2e-4", "4e-4")},
    "lrdecay_eta2": ("async η=2 cosine lr", "async", 2,
                     {"trainer.lr_schedule": "cosine", "trainer.decay_steps": 150, "trainer.min_lr_ratio": 0.1}, False),
}
# issue 60 item 4: the recipes the field trains with, each at the quickstart's settings otherwise (async η=2,
# dynamic sampling of uniform groups on, lr 1e-5), compared with GRPO (async_eta2, the quickstart's default);
# docs/recipes.md maps each onto the peers' names, configs/quickstart-*.yaml ship the ones with a config
RECIPES = {
    "gspo_eta2": ("GSPO (sequence ratio, seq-mean-token-mean)", "async", 2,
                  {"trainer.policy_loss": "gspo", "trainer.loss_agg": "seq-mean-token-mean",
                   "trainer.eps_clip_low": 3e-4, "trainer.eps_clip_high": 4e-4}, False),
    "drgrpo_eta2": ("Dr. GRPO (constant 64, no std)", "async", 2,
                    {"trainer.loss_agg": "constant", "trainer.loss_agg_constant": 64.0,
                     "trainer.adv_std_norm": False}, False),
    "dapo_eta2": ("DAPO (clip-higher, by outcome, overlong)", "async", 2,
                  {"trainer.eps_clip_high": 0.28, "controller.uniform_by": "outcome",
                   "controller.overlong_buffer": 16, "controller.overlong_filter": True}, False),
    "reinforcepp_eta2": ("REINFORCE++ (KL 1e-3 in the returns, token-normalised)", "async", 2,
                         {"trainer.adv_estimator": "reinforce_pp", "trainer.kl_coef": 1e-3,
                          "trainer.kl_in": "reward_normalized"}, False),
    "rloo_eta2": ("RLOO (leave-one-out, no std)", "async", 2,
                  {"trainer.adv_baseline": "leave_one_out", "trainer.adv_std_norm": False}, False),
    "cispo_eta2": ("CISPO (ε_high 0.28)", "async", 2, {"trainer.policy_loss": "cispo", "trainer.eps_clip_high": 0.28},
                   False),
}
LEVERS = {**LEVERS, **RECIPES}
# a lever that changes the task's settings is compared with sync at the same settings, not with the study's sync
BASES = {**{name: "async_eta2" for name in RECIPES}, "async_small": "sync_small", "async_lr5e-6": "sync_lr5e-6",
         **{f"lora_eta2_lr{lr}": "async_eta2" for lr in ("5e-5", "1e-4", "2e-4", "4e-4")}}
STUDY = list(MODES)
MODES = {**MODES, **LEVERS}
QUICK_MODES, QUICK_SEEDS, QUICK_VERSIONS, QUICK_EVAL_N = ("sync", "async_eta2"), (0,), 2, 8
QUICK_SETS = {"controller.max_new_tokens": 16, "controller.drop_uniform_groups": False}
PER_STEP = ("entropy", "clip_frac", "masked_frac", "behav_capped_frac", "behav_weight_max", "staleness_max",
            "staleness_violations", "dropped_stale", "reward_mean", "n_seqs")
RUN_TIMEOUT_S = {True: 600, False: 6 * 3600}
# --plan's guesses on CPU when the results file has no finished run to measure from
GUESS = {"startup_s": 60.0, "version_s": 25.0, "eval_problem_s": 0.4}

log = common.logger("quality")


def planned(args) -> list[dict]:
    """The runs of this study, in order (core modes first, seeds interleaved so every mode gets seed 0 first)."""
    modes = args.modes or (list(QUICK_MODES) if args.quick else STUDY)
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        raise SystemExit(f"--modes: unknown {unknown}; known: {', '.join(MODES)}")
    seeds = args.seeds or (list(QUICK_SEEDS) if args.quick else list(CORE_SEEDS))
    runs = []
    for seed in seeds:
        for name in sorted(modes, key=lambda m: not MODES[m][4]):
            if not args.quick and not MODES[name][4] and seed >= args.extra_seeds:
                continue
            runs.append({"mode": name, "seed": seed, "key": run_key(name, seed, args)})
    return runs


def run_key(mode: str, seed: int, args) -> str:
    """What makes two runs the same study cell: mode, seed, length, evaluation size, config, device."""
    return f"{'quick' if args.quick else 'full'}/{mode}/seed{seed}/v{args.versions}/n{args.eval_n}/{args.device}"


def overrides(mode: str, seed: int, args, run_dir: Path) -> dict:
    _, run_mode, eta, trainer, _ = MODES[mode]
    job, bus_in, bus_out, store = free_ports(4)
    threads = SYNC_THREADS if run_mode == "sync" else ASYNC_THREADS
    return {**(QUICK_SETS if args.quick else {}), "run.run_dir": str(run_dir), "run.mode": run_mode,
            "run.seed": seed, "data.seed": seed, "trainer.seed": seed, "controller.max_staleness": eta,
            "controller.total_steps": args.versions, "data.eval_name": EVAL_NAME, "data.eval_size": args.eval_n,
            "eval.size": args.eval_n, "eval.every": args.eval_every, "model.device": args.device,
            "launcher.threads": json.dumps(threads), "brokers.job_port": job, "brokers.bus_in_port": bus_in,
            "brokers.bus_out_port": bus_out, "brokers.store_port": store, "events.console": "json", **trainer}


def launch(run: dict, args, run_dir: Path) -> tuple[float, float, dict]:
    """One `areal-mq run` (training, then its evaluations) in a subprocess; (start time, wall s, overrides)."""
    if run_dir.exists():
        shutil.rmtree(run_dir)  # a cut-off run starts again: a resumed one would mix two wall clocks
    run_dir.mkdir(parents=True)
    sets = overrides(run["mode"], run["seed"], args, run_dir)
    cmd = [sys.executable, "-m", "areal_mq.cli", "run", str(QUICK_CONFIG if args.quick else CONFIG), "--quiet",
           *[x for k, v in sets.items() for x in ("--set", f"{k}={v}")]]
    err_path = run_dir / "launcher.stderr.log"
    started, t0 = time.time(), time.monotonic()
    with open(err_path, "wb") as err:
        proc = subprocess.Popen(cmd, stdout=err, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=ROOT,
                                env={**os.environ, "HF_HUB_OFFLINE": "1"}, start_new_session=True)
    try:
        last = -1
        while not common.exited(proc, 1.0):  # returns as soon as the run ends
            done = count_lines(run_dir / "metrics.jsonl")
            if done != last and done % 5 == 0:
                log(f"{run['key']}: {done}/{args.versions} versions")
                last = done
            if time.monotonic() - t0 > RUN_TIMEOUT_S[args.quick]:
                raise TimeoutError(f"{run['key']} exceeded {RUN_TIMEOUT_S[args.quick]} s; see {err_path}")
    finally:
        stop(proc)
    if proc.returncode != 0:
        tail = err_path.read_text(errors="replace")[-2000:]
        raise RuntimeError(f"{run['key']} failed (exit {proc.returncode}); launcher output ({err_path}):\n{tail}")
    return started, time.monotonic() - t0, sets


def record(run: dict, args, run_dir: Path, started: float, wall_s: float, sets: dict) -> dict:
    """The JSON line of one finished run, read from its metrics.jsonl and eval.jsonl."""
    metrics = sorted(quality_report.read_jsonl(run_dir / "metrics.jsonl"), key=lambda m: m["version"])
    evals = quality_report.read_jsonl(run_dir / "eval.jsonl")
    if len(metrics) < args.versions or not evals:
        raise RuntimeError(f"{run_dir}: {len(metrics)} of {args.versions} steps and {len(evals)} evaluations; "
                           "see launcher.stderr.log and logs/")
    # version -> (trained sequences, wall s since every process was ready: the base model's evaluation, run
    # before training and cached, would otherwise count against whichever mode ran first)
    samples, ready, at = 0, ready_time(run_dir), {0: (0, 0.0)}
    for m in metrics:
        samples += m["n_seqs"]
        at[m["version"]] = (samples, m["time"] - ready)
    points = sorted({e["version"]: e for e in evals if e["version"] in at}.values(), key=lambda e: e["version"])
    if points[-1]["version"] != args.versions:  # a run whose final policy was never evaluated is no result
        raise RuntimeError(f"{run_dir}: the final version v{args.versions} was not evaluated (evaluations at "
                           f"{[p['version'] for p in points]}); see launcher.stderr.log")
    hist: list[int] = []
    for m in metrics:
        h = m.get("staleness_hist", [])
        hist = [a + b for a, b in zip(hist + [0] * (len(h) - len(hist)), h + [0] * (len(hist) - len(h)))]
    label, run_mode, eta, trainer, core = MODES[run["mode"]]
    return {
        "key": run["key"], "mode": run["mode"], "label": label, "seed": run["seed"], "core": core,
        "quick": args.quick, "run_mode": run_mode, "eta": eta, "trainer": trainer, "versions": args.versions,
        "eval_name": EVAL_NAME, "eval_n": args.eval_n, "device": args.device, "wall_s": round(wall_s, 1),
        "startup_s": round(ready - started, 1),
        "date": time.strftime("%Y-%m-%d %H:%M", time.localtime(started)), "overrides": sets,
        "evals": [{"version": e["version"], "strict": e["strict"], "lenient": e["lenient"], "n": e["n"],
                   "trained_samples": at[e["version"]][0], "t_s": round(at[e["version"]][1], 1),
                   "eval_s": e.get("seconds")} for e in points],
        "per_step": {k: [m.get(k) for m in metrics] for k in PER_STEP},
        "staleness_hist": hist, "staleness_violations": int(sum(m.get("staleness_violations", 0) for m in metrics)),
        "dropped_stale": int(sum(m.get("dropped_stale", 0) for m in metrics)),
    }


def prune(run_dir: Path, keep_final: int | None = None) -> None:
    """Keep the run's metrics, evaluations and logs; its weights and checkpoints (~0.5 GB a version) go, except
    weights/v{keep_final} where given (--keep-final: for a later `areal-mq eval --samples N` of the final policy)."""
    for sub in ("checkpoints", "eval_pins") if keep_final is not None else ("weights", "checkpoints", "eval_pins"):
        shutil.rmtree(run_dir / sub, ignore_errors=True)
    weights = run_dir / "weights"
    for version in (weights.iterdir() if keep_final is not None and weights.is_dir() else ()):
        if version.name != f"v{keep_final}":
            shutil.rmtree(version, ignore_errors=True)


def default_plot(args, out: Path) -> Path:
    """The figure's path when --plot is not given: one per run length, so runs of other lengths keep theirs; a study
    of levers only (--modes naming no core mode, e.g. one recipe) draws under OUT, never over the docs/ figure of
    the study it is compared with (the recipes' own figure: recipes_report.py)."""
    if args.quick:
        return out / "quality.png"
    if getattr(args, "modes", None) and not any(MODES[m][4] for m in args.modes if m in MODES):
        return out / f"quality_v{args.versions}.png"
    return ROOT / "docs" / ("quality.png" if args.versions == STUDY_VERSIONS else f"quality_v{args.versions}.png")


def plan_text(runs: list[dict], done: dict, args) -> str:
    """The runs, which are done, and an estimate of the machine time left (from finished runs when any)."""
    est = quality_report.estimate(list(done.values()), GUESS)
    evals_per_run = 2 + (args.versions - 1) // args.eval_every if args.eval_every else 2
    per_run = est["startup_s"] + args.versions * est["version_s"] + evals_per_run * args.eval_n * est["eval_problem_s"]
    todo = [r for r in runs if r["key"] not in done]
    rows = [("run", "seed", "state")] + [(r["mode"], str(r["seed"]), "done" if r["key"] in done else "to run")
                                         for r in runs]
    return "\n".join([*common.align(rows),
                      f"{len(runs)} runs, {len(runs) - len(todo)} done; estimate {per_run / 60:.0f} min a run "
                      f"({est['source']}: start {est['startup_s']:.0f} s, {est['version_s']:.1f} s a version, "
                      f"{evals_per_run} evaluations of {args.eval_n} problems at {est['eval_problem_s']:.2f} s each), "
                      f"{len(todo) * per_run / 3600:.1f} h of machine time left (the base model is evaluated once and "
                      f"cached)"])


def main() -> None:
    parser = common.arg_parser(__doc__, quick_help="configs/tiny.yaml, 2 versions, seed 0, sync + async η=2, "
                                                   f"{QUICK_EVAL_N} problems (~3 min on 2 cores).")
    split = lambda conv: (lambda s: [conv(x) for x in s.split(",") if x])  # noqa: E731
    parser.add_argument("--versions", type=int, help=f"Training steps per run (default {STUDY_VERSIONS}; quick 2).")
    parser.add_argument("--eval-every", type=int, help="Evaluate every N versions (default 10; quick 1).")
    parser.add_argument("--eval-n", type=int, help=f"Held-out problems per evaluation (default 1100; quick {QUICK_EVAL_N}).")
    parser.add_argument("--modes", type=split(str), help=f"Comma-separated subset of: {', '.join(MODES)}.")
    parser.add_argument("--seeds", type=split(int), help="Comma-separated seeds (default 0,1,2; quick 0).")
    parser.add_argument("--extra-seeds", type=int, default=3,
                        help="Seeds (the first N of --seeds) for the non-core modes: η=4 decoupled and the corrections.")
    parser.add_argument("--results", type=Path, help="The JSONL results file (default benchmarks/results/quality.jsonl; "
                                                     "quick: bench-results/quality-quick/quality.jsonl).")
    parser.add_argument("--out", type=Path, help="Where run dirs go (default bench-results/quality[-quick]).")
    parser.add_argument("--plot", type=Path, help=f"PNG path (default docs/quality.png at {STUDY_VERSIONS} versions, "
                                                  "else docs/quality_vN.png; quick, or --modes naming no core mode: "
                                                  "OUT/quality[_vN].png).")
    parser.add_argument("--plan", action="store_true", help="Print the runs and an estimate of machine time; run nothing.")
    parser.add_argument("--report-only", action="store_true", help="Report the results file; run nothing.")
    parser.add_argument("--keep-final", action="store_true", help="Keep each run's final weights (weights/vN, "
                        "~0.5 GB a run) for a later evaluation, e.g. pass@k: areal-mq eval --weights RUN/weights/vN.")
    common.add_device_arg(parser)
    args = parser.parse_args()
    default = lambda given, quick, full: given if given is not None else quick if args.quick else full  # noqa: E731
    args.versions = default(args.versions, QUICK_VERSIONS, STUDY_VERSIONS)
    args.eval_every = default(args.eval_every, QUICK_VERSIONS - 1, 10)
    args.eval_n = default(args.eval_n, QUICK_EVAL_N, 1100)
    for flag in ("versions", "eval_every", "eval_n", "extra_seeds"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be >= 1")
    out = args.out or ROOT / "bench-results" / ("quality-quick" if args.quick else "quality")
    results = args.results or (out / "quality.jsonl" if args.quick else RESULTS)
    runs = planned(args)
    done = {r["key"]: r for r in quality_report.read_jsonl(results)}
    if args.plan:
        print(plan_text(runs, done, args))
        return
    started = time.monotonic()
    if not args.report_only:
        for run in runs:
            if run["key"] in done:
                log(f"{run['key']}: done, skipped")
                continue
            run_dir = out / f"{run['mode']}-seed{run['seed']}-v{args.versions}"  # runs of another length keep theirs
            line = record(run, args, run_dir, *launch(run, args, run_dir))
            prune(run_dir, args.versions if args.keep_final else None)
            results.parent.mkdir(parents=True, exist_ok=True)
            with open(results, "a") as f:
                f.write(json.dumps(line) + "\n")
            done[run["key"]] = line
            log(f"{run['key']}: final strict {line['evals'][-1]['strict']:.1%} in {line['wall_s']:.0f} s")
    lines = [done[r["key"]] for r in runs if r["key"] in done]
    if not lines:
        raise SystemExit(f"{results} holds none of this study's runs yet (see --plan)")
    report = quality_report.report(lines, args.quick, args.plot or default_plot(args, out), BASES)
    report["results_file"] = str(results)
    report["wall_s"] = round(time.monotonic() - started, 1)
    common.finish(report, args.json, quality_report.table(report, common.command("quality.py")))


if __name__ == "__main__":
    main()
