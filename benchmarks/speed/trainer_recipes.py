"""Trainer benchmark, recipes (issue 60 item 4): what a training step costs under each recipe, side by side.

What it measures: the quickstart's trainer (configs/quickstart.yaml `trainer:`; SmolLM2-135M-Instruct, fp32, one
torch thread) trains the SAME batch (the quickstart's shape: 4 groups x 4, a 151-token prompt, generated lengths
long-tailed up to 64 tokens) under GRPO (the default) and under each recipe of benchmarks/quality/quality.py
`RECIPES`, with that recipe's `trainer.*` settings, in rounds whose order reverses every other round. Each (recipe,
round) builds a fresh Trainer (a recipe with `kl_coef > 0` loads its reference model, which is part of its cost),
takes one warm-up step and `steps` measured steps. Reported per recipe: the median step seconds, its ratio to GRPO's
(`<recipe>_vs_grpo_step_s`, > 1 when the recipe's step is slower), the build seconds and the step's no-grad
recompute (the reference model's logprobs, where a recipe has one; the proximal ones need none at one mini-batch). Settings under `controller.*` (DAPO's dynamic sampling by outcome, its overlong shaping) cost nothing in the
trainer: they change how many groups are generated per trained group, which a run's controller events report
(benchmarks/quality/RESULTS.md); the table names them.

    python benchmarks/speed/trainer.py --recipes [--quick] [--json PATH] [--threads N]
    (or python benchmarks/speed/trainer_recipes.py ...)

--quick: the tiny random Llama, a 2 x 2 batch, one round of one step per recipe; the same code path in seconds.
"""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py (it adds the kinds' folders)
import common  # noqa: E402
import quality  # noqa: E402  (benchmarks/quality/, on sys.path through common)
from trainer import longtail_batch  # noqa: E402  (benchmarks/speed/trainer.py)

REPO = Path(__file__).resolve().parents[2]
BASE = "grpo"
SIZES = {  # quick, full
    "model": ("tiny-random-llama", "smollm2-135m-instruct"), "groups": (2, 4), "group_size": (2, 4),
    "prompt_len": (16, 151), "gen_median": (12, 24), "gen_max": (32, 64), "rounds": (1, 2), "steps": (1, 2),
}

log = common.logger("trainer_recipes")


def recipes() -> dict[str, tuple[str, dict, dict]]:
    """name -> (label, trainer.* overrides, controller.* overrides), GRPO (no overrides) first."""
    out = {BASE: ("GRPO (the quickstart)", {}, {})}
    for mode, (label, _kind, _eta, overrides, _base) in quality.RECIPES.items():
        trainer = {k.split(".", 1)[1]: v for k, v in overrides.items() if k.startswith("trainer.")}
        other = {k: v for k, v in overrides.items() if not k.startswith("trainer.")}
        out[mode.removesuffix("_eta2")] = (label, trainer, other)
    return out


def run(args) -> dict:
    import torch
    from tqdm import tqdm

    from areal_mq.algorithms.trainer import Trainer
    from areal_mq.config import load_config
    from areal_mq.engines.models import resolve_model

    q = 0 if args.quick else 1
    size = {k: v[q] for k, v in SIZES.items()}
    torch.set_num_threads(args.threads)
    base_cfg = load_config(REPO / "configs" / "quickstart.yaml").trainer
    plan = recipes()
    if args.only:
        unknown = sorted(set(args.only) - set(plan))
        if unknown:
            raise SystemExit(f"--only: unknown recipe(s) {unknown}; known: {sorted(plan)}")
        plan = {k: v for k, v in plan.items() if k in args.only or k == BASE}
    cfgs = {name: base_cfg.model_copy(update=trainer) for name, (_, trainer, _) in plan.items()}
    for name, cfg in cfgs.items():  # the overrides validated as a user's config would be
        type(cfg).model_validate(cfg.model_dump())
    plen = size["prompt_len"]
    batch = longtail_batch(0, size["groups"], size["group_size"], (plen, plen + 1), size["gen_median"],
                           size["gen_max"])
    tokens = sum(len(s.prompt_ids) + len(s.output_ids) for smp in batch for s in smp.seqs)
    model_path = resolve_model(size["model"])
    names = list(plan)
    order = [n for r in range(size["rounds"]) for n in (names if r % 2 == 0 else names[::-1])]
    per: dict[str, dict] = {n: {"step_s": [], "build_s": [], "recompute_s": []} for n in names}
    for name in tqdm(order, desc="recipes", unit="trainer", file=sys.stderr):
        t0 = time.perf_counter()
        trainer = Trainer(cfgs[name], model_path, device="cpu", engine_dtype="float32")
        per[name]["build_s"].append(time.perf_counter() - t0)
        trainer.train_step(longtail_batch(1, 1, 2, (8, 9), 8, 16))  # warm-up: allocator, kernels, AdamW's state
        for _ in range(size["steps"]):
            m = trainer.train_step(batch)
            per[name]["step_s"].append(m["step_s"])
            per[name]["recompute_s"].append(m["prox_recompute_s"])
        per[name]["has_ref"] = trainer.ref_model is not None
        del trainer
    grpo = float(np.median(per[BASE]["step_s"]))
    results, ratios = [], {}
    for name in names:
        label, trainer_o, other_o = plan[name]
        med = float(np.median(per[name]["step_s"]))
        results.append({"name": name, "label": label, "trainer_overrides": trainer_o, "sampling_overrides": other_o,
                        "step_s_median": med, "step_s": [round(s, 3) for s in per[name]["step_s"]],
                        "build_s": [round(s, 2) for s in per[name]["build_s"]], "reference_model": per[name]["has_ref"],
                        "recompute_s_median": float(np.median(per[name]["recompute_s"])),
                        "tokens_per_s": tokens / med})
        if name != BASE:
            ratios[f"{name}_vs_grpo_step_s"] = med / grpo
    setup = {"name": "setup", "model": size["model"], "sequences": sum(len(s.seqs) for s in batch), "tokens": tokens,
             "rounds": size["rounds"], "steps_per_round": size["steps"], "threads": args.threads,
             "trainer_config": "configs/quickstart.yaml"}
    return {"benchmark": "trainer_recipes", "quick": args.quick, "machine": common.torch_machine(),
            "results": [setup, *results], "ratios": ratios, "targets": {}}


def table(report: dict, command: str) -> str:
    setup, *rows = report["results"]
    head = ("recipe", "step s (median)", "vs GRPO", "ref model", "recompute s", "build s", "sampling-side settings")
    out = [head]
    for r in rows:
        ratio = report["ratios"].get(f"{r['name']}_vs_grpo_step_s")
        out.append((r["name"], f"{r['step_s_median']:.2f}", "1.00" if ratio is None else f"{ratio:.2f}",
                    "yes" if r["reference_model"] else "no", f"{r['recompute_s_median']:.2f}", f"{np.median(r['build_s']):.1f}",
                    ", ".join(f"{k.split('.', 1)[1]}={v}" for k, v in r["sampling_overrides"].items()) or "-"))
    note = (f"{setup['model']}: {setup['sequences']} sequences, {setup['tokens']} tokens a step; {setup['rounds']} "
            f"rounds x {setup['steps_per_round']} steps, order reversed every other round; load avg "
            f"{report['machine']['loadavg_at_start'][0]:.1f}")
    return "\n".join([*common.align(out), note, f"command: {command}"])


def main() -> None:
    parser = common.arg_parser(__doc__, quick_help="The tiny random Llama, one step per recipe; seconds.")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (one: the quickstart trainer's).")
    parser.add_argument("--only", nargs="+", default=None, help="These recipes (and GRPO) only.")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    report = common.timed(run, args)
    command = " ".join(["python benchmarks/speed/trainer.py --recipes", *sys.argv[1:]])  # trainer.py drops the flag
    common.finish(report, args.json, table(report, command))


if __name__ == "__main__":
    main()
