"""Stage p: which precision learns on a GPU — the quickstart-gpu config to v50 under three engine/trainer pairs.

What it measures (issue 51, item 5): configs/quickstart-gpu.yaml on the real SmolLM2-135M-Instruct weights (stage e's
run, one seed), once per pair, the three runs side by side on the one device (a 135M model leaves it mostly idle):
  bf16/bf16   engine bf16, trainer bf16 autocast (today's GPU default)
  fp16/fp16   engine fp16, trainer fp16 autocast with loss scaling (algorithms/scaler.py)
  bf16/fp32   engine bf16, trainer fp32 (the trainer's own numbers exact; the engine's rounding remains)
Reported per pair: held-out strict and lenient at the base, v25 and v50 (greedy, 200 problems, eval.jsonl), and the
mismatch_kl of every step (metrics.jsonl: KL between the engine's and the trainer's logprobs of the same tokens at
staleness 0; anything but 0 is numerics): its mean and maximum, and the steps' list in the JSON. The CPU reference
is fp32/fp32 (held-out strict 42-45 % at v50). A pair that learns clearly best (strict at v50 ahead of the others by
more than the seed noise, ~4 points on 200 problems) should become the GPU default (rollout.engine.dtype,
trainer.precision); with one seed the table says which pairs to run more seeds of.
--quick: the tiny random Llama, 2 steps (stage e's quick sizes), same code path; on the CPU fp16 runs slowly, and
no periodic evaluation runs (eval.every 0: the base and the last version are still evaluated, by the launcher in
each pair's precision; stage e smokes the periodic evaluator, three more background evaluations on 2 cores only
repeat it, issue 58).

    python benchmarks/gpu/stage_p_precision.py [--device cuda] [--quick] [--out DIR] [--work DIR]
"""
from __future__ import annotations

import statistics
import threading

import report
import stage_e_quickstart as e
from report import common

PAIRS = {"bf16/bf16": {"rollout.engine.dtype": "bfloat16", "trainer.precision": "bf16", "trainer.publish_dtype": "bfloat16"},
         "fp16/fp16": {"rollout.engine.dtype": "float16", "trainer.precision": "fp16", "trainer.publish_dtype": "float16"},
         "bf16/fp32": {"rollout.engine.dtype": "bfloat16", "trainer.precision": "fp32", "trainer.publish_dtype": "bfloat16"}}
QUICK_CPU = {"eval.every": 0}  # see the docstring
log = common.logger("gpu-p")


def one(args, name: str, out: dict) -> None:
    from areal_mq.telemetry.plots import read_jsonl

    run_dir = args.work / f"precision-{name.replace('/', '-')}"
    try:
        _, wall = e.launch(args, run_dir, {**(QUICK_CPU if report.cpu_smoke(args) else {}), **PAIRS[name]})
    except SystemExit as exc:  # one failed pair is reported, the others still run
        out[name] = {"error": str(exc)[-2000:]}
        return
    evals = {int(r["version"]): r for r in read_jsonl(run_dir / "eval.jsonl") if isinstance(r.get("version"), int)}
    kl = [m["mismatch_kl"] for m in read_jsonl(run_dir / "metrics.jsonl") if m.get("mismatch_kl") is not None]
    out[name] = {"wall_s": round(wall, 1), "settings": PAIRS[name],
                 "heldout": {v: {"strict": r["strict"], "lenient": r["lenient"], "n": r["n"]} for v, r in sorted(evals.items())},
                 "mismatch_kl": kl, "mismatch_kl_mean": statistics.fmean(kl) if kl else None,
                 "mismatch_kl_max": max(kl) if kl else None}
    log(f"{name}: done in {wall:.0f} s, strict at the last version "
        f"{evals[max(evals)]['strict'] if evals else '-'}, mismatch_kl mean {out[name]['mismatch_kl_mean']}")


def run(args) -> dict:
    if not args.quick:
        from areal_mq.engines.models import gguf_path

        gguf_path()  # ModelNotFound with the fix when the GGUF was not delivered (run.sh model-a / model-b)
    results: dict = {}
    threads = [threading.Thread(target=one, args=(args, name, results)) for name in PAIRS]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    last = {name: max(r["heldout"]) if r.get("heldout") else None for name, r in results.items()}
    strict = {name: results[name]["heldout"][v]["strict"] for name, v in last.items() if v is not None}
    best = max(strict, key=strict.get) if strict and len(set(strict.values())) > 1 else None  # None: a tie
    return {"title": "precision pairs: quickstart-gpu to the last version", "quick": args.quick,
            "machine": report.machine(args.device), "pairs": results, "strict_last": strict, "best": best}


def markdown(r: dict) -> str:
    rows = [("engine/trainer", "strict base", "strict last", "lenient last", "mismatch_kl mean", "mismatch_kl max",
             "wall s")]
    for name, p in r["pairs"].items():
        if "error" in p:
            rows.append((name, "failed", p["error"][-120:], "", "", "", ""))
            continue
        h = p["heldout"]
        base, last = h.get(0) or h.get("0"), h[max(h)]
        fmt = (lambda v: "-" if v is None else f"{v:.2e}")
        rows.append((name, "-" if base is None else f"{base['strict']:.1%}", f"{last['strict']:.1%}",
                     f"{last['lenient']:.1%}", fmt(p["mismatch_kl_mean"]), fmt(p["mismatch_kl_max"]), p["wall_s"]))
    return report.table(rows) + f"\n\nhighest strict at the last version: {r['best'] or 'a tie'} (one seed each: a lead " \
        "under ~4 points on 200 problems is within the seed noise)"


def main() -> None:
    report.stage(__doc__, "p", run, markdown)


if __name__ == "__main__":
    main()
