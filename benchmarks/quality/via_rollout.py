"""Evaluation through the rollout engines against a standalone evaluation, problem by problem (issue 60 item 3).

What: one `areal-mq run configs/quickstart.yaml` (SmolLM2-135M-Instruct, the real tokenizer, every process) with
`eval.via: rollout`, `eval.every` E and `controller.total_steps` T: the controller sends the held-out problems to the
rollout worker pinned to every due version (E, 2E, ... below T) while training goes on (workers/controller_eval.py).
Then each version the controller evaluated is evaluated again standalone, the engine `areal-mq eval` builds
(evaluation/heldout.py generate_answers), from the same published weights; the two answers to every problem are
compared as text. Greedy decoding, so the target is every answer equal (`via_rollout_equal_fraction` = 1.0).
Beside it: strict accuracy both ways, the evaluation's seconds both ways (through the rollout engines it shares the
worker with training, so its seconds are not the same measure: reported, not compared), and what the pin cost the
training (staleness of the samples trained during the run, from metrics.jsonl).

    python benchmarks/quality/via_rollout.py [--steps 5] [--every 2] [--eval-n 200] [--json PATH]
    python benchmarks/quality/via_rollout.py --quick   # configs/tiny.yaml, 8 problems: the code path, a minute
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
import common  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
log = common.logger("via-rollout")


def train(run_dir: Path, config: Path, steps: int, every: int, eval_n: int, extra: list[str]) -> float:
    """The run, with its periodic evaluations through the rollout engines; its wall seconds."""
    job, bus_in, bus_out, store = common.free_ports(4)
    sets = {"run.run_dir": str(run_dir), "controller.total_steps": steps, "eval.every": every, "eval.via": "rollout",
            "eval.size": eval_n, "data.eval_size": eval_n, "trainer.keep_weight_versions": steps + 1,
            "brokers.job_port": job, "brokers.bus_in_port": bus_in, "brokers.bus_out_port": bus_out,
            "brokers.store_port": store, "events.console": "json"}
    cmd = [sys.executable, "-m", "areal_mq.cli", "run", str(config), "--quiet",
           *[x for k, v in sets.items() for x in ("--set", f"{k}={v}")], *extra]
    err = run_dir.parent / f"{run_dir.name}.launcher.log"
    t0 = time.monotonic()
    with open(err, "wb") as out:
        done = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=ROOT,
                              env={**os.environ, "HF_HUB_OFFLINE": "1"})
    if done.returncode != 0:
        raise RuntimeError(f"the run failed (exit {done.returncode}); its output: {err}\n"
                           + err.read_text(errors="replace")[-2000:])
    return time.monotonic() - t0


def compare(run_dir: Path) -> list[dict]:
    """Per version evaluated through the rollout engines: its answers against a standalone evaluation's."""
    from areal_mq.config import load_config
    from areal_mq.evaluation.heldout import eval_params, generate_answers, score

    cfg = load_config(run_dir / "config.yaml")
    samples, sampling, _ = eval_params(cfg)
    if sampling.temperature != 0.0 or samples != 1:
        raise SystemExit("eval: greedy, one answer a problem, or the comparison means nothing")
    evals = [json.loads(line) for line in (run_dir / "eval.jsonl").read_text().splitlines()]
    rows = []
    for rec in [e for e in evals if e.get("via") == "rollout"]:
        v = rec["version"]
        pinned = {}
        for line in (run_dir / "eval_answers" / f"v{v}.jsonl").read_text().splitlines():
            a = json.loads(line)
            pinned[a["id"]] = a["text"]
        log(f"v{v}: {len(pinned)} answers through the rollout engines; the standalone evaluation of the same weights")
        outputs, problems, seconds = generate_answers(cfg, str(run_dir / "weights" / f"v{v}"), v, None, samples,
                                                      sampling, True)
        alone = {o.request_id: o.text for o in outputs}
        differ = sorted(k for k in alone.keys() | pinned.keys() if alone.get(k) != pinned.get(k))
        strict_alone = score(outputs, problems, samples, ())["strict"]
        rows.append({"version": v, "n": len(alone), "n_through": len(pinned), "equal": len(alone) - len(differ),
                     "differ": differ[:20], "strict_through": rec["strict"], "strict_standalone": strict_alone,
                     "seconds_through": rec.get("seconds"), "seconds_standalone": round(seconds, 1)})
    return rows


def run(args, tmp: Path) -> dict:
    config = ROOT / "configs" / ("tiny.yaml" if args.quick else "quickstart.yaml")
    steps, every, eval_n = (3, 1, 8) if args.quick else (args.steps, args.every, args.eval_n)
    run_dir = tmp / "via-rollout"
    log(f"{config.name}: {steps} steps, evaluations through the rollout engines every {every} ({eval_n} problems)")
    wall = train(run_dir, config, steps, every, eval_n, [])
    skipped = []
    for path in (run_dir / "events").glob("*.jsonl"):
        skipped += [r for r in map(json.loads, path.read_text().splitlines()) if r.get("event") == "controller.eval_skipped"]
    rows = compare(run_dir)
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    total = sum(r["n"] for r in rows)
    equal = sum(r["equal"] for r in rows)
    return {
        "machine": common.machine(), "config": config.name, "steps": steps, "every": every, "eval_n": eval_n,
        "run_wall_s": round(wall, 1), "versions": rows,
        "skipped": [{"version": s.get("version"), "reason": s.get("reason")} for s in skipped],
        "staleness_max": max((m.get("staleness_max") or 0) for m in metrics),
        "ratios": {"via_rollout_equal_fraction": round(equal / total, 4) if total else None},
        "targets": {"via_rollout_equal_fraction": 1.0},
    }


def table(report: dict) -> str:
    rows = [("version", "answers", "equal", "strict through", "strict standalone", "s through", "s standalone")]
    for r in report["versions"]:
        rows.append((f"v{r['version']}", r["n"], r["equal"], f"{r['strict_through']:.3f}",
                     f"{r['strict_standalone']:.3f}", r["seconds_through"], r["seconds_standalone"]))
    lines = common.align(rows)
    for s in report["skipped"]:
        lines.append(f"v{s['version']} skipped by the controller: {s['reason']}")
    lines += ["", *common.align(common.ratio_rows(report)), common.command("via_rollout.py")]
    return "\n".join(lines)


def main() -> None:
    parser = common.arg_parser(__doc__)
    parser.add_argument("--steps", type=int, default=5, help="Training steps (default 5).")
    parser.add_argument("--every", type=int, default=2, help="Evaluate every N versions (default 2: v2 and v4).")
    parser.add_argument("--eval-n", type=int, default=200, help="Held-out problems (default 200, the quickstart's).")
    args = parser.parse_args()
    report = common.timed(run, args, tmp_prefix="areal-via-rollout-")
    if not report["versions"]:
        common.finish(report, args.json, table(report))
        raise SystemExit("no version was evaluated through the rollout engines (see the skipped reasons above)")
    common.finish(report, args.json, table(report))


if __name__ == "__main__":
    main()
