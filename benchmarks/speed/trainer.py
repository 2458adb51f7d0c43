"""Trainer benchmark: shared-prompt packing vs dynamic packing vs fixed-size padded micro-batches, side by side.

What it measures, in one run, on SmolLM2-135M-Instruct (fp32 master weights, CPU):
  the same long-tail batch of sequences (lognormal generated lengths: many short, a few long — the shape
  of real RL rollouts) is trained with full decoupled-PPO train_steps, alternating
  - packed: first-fit-decreasing bins under `max_tokens_per_mb`, one padding-free row per micro-batch
    (position ids restart per sequence, block-diagonal causal attention), and
  - padded: `padded_mb_size` sequences per micro-batch in arrival order, right-padded, where the size
    is chosen so that a padded micro-batch holds the same number of REAL tokens on average as the
    packed budget (same nominal memory per micro-batch), and
  - shared (the trainer's default): packed, with each group's prompt computed once for its completions
    (tree attention mask). Its gain grows with the prompt's share of the tokens: the default batch has
    prompts of 24-64 tokens; `--prompt-len 151` is the quickstart's one-shot prompt.
Training tokens/s counts real tokens (prompt + generated) per wall second of the whole step (proximal
recompute, forward/backward, optimizer); the ratio `packed_vs_padded_tokens_per_s` is the median packed
step throughput over the median padded one (medians: robust to a neighbour's burst on a shared
machine); `shared_vs_dynamic_tokens_per_s` compares shared with packed the same way (same logical tokens
per step, so it is the step-time ratio). It also reports the cost of the proximal-logprob recompute.
One torch thread by default: on an oversubscribed machine a descheduled OpenMP thread stalls every
parallel kernel, which makes step time track the number of kernels rather than the work and hides
the difference being measured; pass --threads 2 on an idle machine.

--device cuda (or cuda:N) trains on that GPU as the trainer of a bf16 engine does (trainer.precision auto
follows the engine's dtype: bf16 autocast over fp32 master weights); default cpu. benchmarks/gpu/run.sh stage c compares the trainer with a plain fwd+bwd+AdamW loop.

    python benchmarks/speed/trainer.py [--quick] [--json PATH] [--threads N] [--device cpu|cuda|cuda:N]
    python benchmarks/speed/trainer.py --strategy fsdp --world 2 [--quick] [--json PATH]   (benchmarks/speed/trainer_fsdp.py)
    python benchmarks/speed/trainer.py --load [--quick] [--json PATH]   (benchmarks/speed/trainer_load.py: load peak)
    python benchmarks/speed/trainer.py --lora [--quick] [--json PATH]   (benchmarks/speed/trainer_lora.py: full vs LoRA)
    python benchmarks/speed/trainer.py --root [--quick] [--json PATH]   (benchmarks/speed/trainer_root.py: FSDP2 units)
    python benchmarks/speed/trainer.py --long [--quick] [--json PATH]   (benchmarks/speed/trainer_long.py: mask vs varlen)
    python benchmarks/speed/trainer.py --recipes [--quick] [--json PATH]   (benchmarks/speed/trainer_recipes.py: a step per recipe)

`--quick` uses fewer, shorter sequences and one alternation (same code path, same long-tail shape); it
finishes in under a minute on 2 idle cores. benchmarks/RESULTS.md records runs.
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py (it adds the kinds' folders)
import common  # noqa: E402

TARGETS = {"packed_vs_padded_tokens_per_s": 1.3, "shared_vs_dynamic_tokens_per_s": 1.0}
MODES = ("packed", "padded", "shared")
SIZES = {  # quick, full
    "groups": (4, 8), "group_size": (4, 4), "prompt_len": ((8, 24), (24, 64)),
    "gen_median": (12, 48), "gen_max": (240, 512), "budget": (384, 2048), "rounds": (1, 2),
}


log = common.logger("trainer")
# the comparisons with a script of their own, in benchmarks/speed/: flag -> module
SUB_BENCHMARKS = {
    "--recipes": "trainer_recipes",  # GRPO and each recipe's trainer settings, a step's cost side by side (issue 60)
    "--long": "trainer_long",  # one micro-batch at growing lengths: the L x L mask vs block by block (issue 61)
    "--root": "trainer_root",  # FSDP2: the root holding embeddings + head vs units of their own (issue 59)
    "--lora": "trainer_lora",  # full fine-tuning vs a LoRA adapter, peak memory (issue 53)
    "--load": "trainer_load",  # loading the sharded trainer, old path vs each rank's shards (issue 52)
}


def longtail_batch(seed: int, groups: int, group_size: int, prompt_len: tuple[int, int], median: int,
                   max_len: int) -> list:
    """Sample groups whose generated lengths are lognormal (sigma 1): median `median`, tail to `max_len`."""
    from areal_mq.messages import Sample, SeqSample

    rng = np.random.default_rng(seed)
    samples = []
    for g in range(groups):
        prompt = rng.integers(100, 49000, rng.integers(*prompt_len), dtype=np.int32)
        seqs = []
        for _ in range(group_size):
            n = int(np.clip(rng.lognormal(np.log(median), 1.0), 4, max_len))
            seqs.append(SeqSample(prompt_ids=prompt, output_ids=rng.integers(100, 49000, n, dtype=np.int32),
                                  logprobs=np.full(n, -8.0, np.float32), versions=np.zeros(n, np.int32),
                                  reward=float(rng.integers(0, 2))))
        samples.append(Sample(sample_id=f"b{g}", seqs=seqs))
    return samples


def padded_tokens(lengths: list[int], size: int) -> int:
    """Tokens a padded plan computes (rows x longest row, per micro-batch of `size` in order)."""
    return sum(max(lengths[i:i + size]) * len(lengths[i:i + size]) for i in range(0, len(lengths), size))


def run(args: argparse.Namespace) -> dict:
    import torch
    from tqdm import tqdm

    from areal_mq.algorithms.config import TrainerConfig
    from areal_mq.algorithms.trainer import Trainer
    from areal_mq.devices import resolve_device
    from areal_mq.engines.models import resolve_model

    q = 0 if args.quick else 1
    size = {k: v[q] for k, v in SIZES.items()}
    torch.set_num_threads(args.threads)
    prompt_len = (args.prompt_len, args.prompt_len + 1) if args.prompt_len else size["prompt_len"]
    batch = longtail_batch(0, size["groups"], size["group_size"], prompt_len, size["gen_median"], size["gen_max"])
    lengths = [len(s.prompt_ids) + len(s.output_ids) for smp in batch for s in smp.seqs]
    mb_size = max(1, round(size["budget"] / np.mean(lengths)))
    base = TrainerConfig(lr=1e-7, max_tokens_per_mb=size["budget"], padded_mb_size=mb_size)
    cfgs = {"packed": base.model_copy(update={"packing": "dynamic"}),
            "padded": base.model_copy(update={"packing": "padded"}), "shared": base.model_copy(update={"packing": "shared"})}
    log(f"{len(lengths)} sequences, {sum(lengths)} tokens (median {int(np.median(lengths))}, max {max(lengths)}); "
        f"packed budget {size['budget']} tokens, padded {mb_size} seqs/micro-batch")
    t0 = time.perf_counter()
    trainer = Trainer(base, resolve_model("smollm2-135m-instruct"), device=args.device,
                      engine_dtype="bfloat16" if resolve_device(args.device).type == "cuda" else "float32")
    load_s = time.perf_counter() - t0
    trainer.train_step(longtail_batch(1, 1, 2, (8, 9), 8, 16))  # warm-up: allocator, kernels
    steps: dict[str, list[dict]] = {m: [] for m in MODES}
    order = [m for r in range(size["rounds"]) for m in (MODES if r % 2 == 0 else MODES[::-1])]
    for mode in tqdm(order, desc="train steps", unit="step", file=sys.stderr):
        trainer.cfg = cfgs[mode]
        steps[mode].append(trainer.train_step(batch))
    results = []
    for mode, ms in steps.items():
        total_s = sum(m["step_s"] for m in ms)
        results.append({
            "name": mode, "steps": len(ms), "tokens_per_step": ms[0]["n_tokens"],
            "tokens_per_s": float(np.median([m["tokens_per_s"] for m in ms])),
            "tokens_per_s_total": ms[0]["n_tokens"] * len(ms) / total_s,
            "step_s": [round(m["step_s"], 3) for m in ms],
            "prox_recompute_s": [round(m["prox_recompute_s"], 3) for m in ms],
            "prox_recompute_share": sum(m["prox_recompute_s"] for m in ms) / total_s,
            "microbatches_per_step": ms[0]["n_microbatches"],
            "computed_tokens_per_step": (padded_tokens(lengths, mb_size) if mode == "padded"
                                         else int(np.mean([m["fwd_tokens"] for m in ms]))),
        })
    by = {r["name"]: r for r in results}
    ratios = {"packed_vs_padded_tokens_per_s": by["packed"]["tokens_per_s"] / by["padded"]["tokens_per_s"],
              "shared_vs_dynamic_tokens_per_s": by["shared"]["tokens_per_s"] / by["packed"]["tokens_per_s"]}
    setup = {"name": "setup", "sequences": len(lengths), "tokens": sum(lengths), "median_len": float(np.median(lengths)),
             "max_len": max(lengths), "prompt_len": list(prompt_len), "budget": size["budget"], "padded_mb_size": mb_size, "model_load_s": load_s,
             "threads": args.threads, "precision": trainer.precision, "device": str(trainer.device)}
    machine = common.torch_machine(device=common.device_name(args.device))
    return {"benchmark": "trainer", "quick": args.quick, "machine": machine, "results": [setup, *results],
            "ratios": ratios, "targets": dict(TARGETS)}


def table(report: dict, command: str) -> str:
    setup, *modes = report["results"]
    by = {r["name"]: r for r in modes}
    head = ("metric", *MODES, "ratio", "target", "met")

    def ratio_row(label: str, key: str, values: list[str]) -> tuple:
        r, t = report["ratios"][key], report["targets"][key]
        return (label, *values, f"{r:.2f}", f">= {t}", common.met(r, t))

    tps = [f"{by[m]['tokens_per_s']:.1f}" for m in MODES]
    rows = [head,
            ratio_row("training tokens/s (packed/padded)", "packed_vs_padded_tokens_per_s", tps),
            ratio_row("training tokens/s (shared/packed)", "shared_vs_dynamic_tokens_per_s", tps),
            ("micro-batches per step", *[str(by[m]["microbatches_per_step"]) for m in MODES], "-", "-", "-"),
            ("tokens computed per step", *[str(by[m]["computed_tokens_per_step"]) for m in MODES], "-", "-", "-"),
            ("proximal recompute share of step", *[f"{by[m]['prox_recompute_share']:.1%}" for m in MODES],
             "-", "-", "-")]
    note = (f"{setup['sequences']} seqs, {setup['tokens']} tokens/step (median {setup['median_len']:.0f}, max "
            f"{setup['max_len']}, prompts {setup['prompt_len'][0]}+ tokens); budget {setup['budget']}, padded "
            f"{setup['padded_mb_size']} seqs/mb; load avg {report['machine']['loadavg_at_start'][0]:.1f}")
    return "\n".join([*common.align(rows), note, f"command: {command}"])


def main() -> None:
    for flag, module in SUB_BENCHMARKS.items():  # a flag hands the run to its own script (it drops the flag)
        if flag in sys.argv:
            sys.argv = [a for a in sys.argv if a != flag]
            return importlib.import_module(module).main()
    if "--strategy" in sys.argv:  # the sharded comparison (issue 37): its own script, same flags
        import trainer_fsdp

        sys.argv = [a for i, a in enumerate(sys.argv) if a != "--strategy" and sys.argv[i - 1] != "--strategy"]
        return trainer_fsdp.main()
    parser = common.arg_parser(__doc__, quick_help="Fewer, shorter sequences; about a minute on 2 cores.")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (see module docstring).")
    parser.add_argument("--prompt-len", type=int, default=0, help="Fixed prompt length (default: the size's range).")
    common.add_device_arg(parser)
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    report = common.timed(run, args)
    common.finish(report, args.json, table(report, common.command("trainer.py")))


if __name__ == "__main__":
    main()
