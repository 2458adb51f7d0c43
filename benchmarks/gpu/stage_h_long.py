"""Stage h: long answers on a GPU: one packed micro-batch of the Qwen2.5-7B shape at 8k, 16k and 32k tokens, the
dense L x L mask (trainer.attention sdpa) against block-by-block attention (varlen), peak memory and time per token.

What it does: benchmarks/speed/trainer_long.py's measurement (its `run`: each (attention, L) in a fresh process, a
warm-up step on a short batch, then one train_step of a GRPO group of 4 answers after a 256-token prompt, gradient
checkpointing, bf16 autocast over fp32 master weights) with `--device cuda`, the Qwen2.5-7B shape cut to 4 decoder
layers (all 28 with AdamW's fp32 state are 120 GB, over one GPU; the attention's memory under checkpointing is one
layer's, so 4 layers keep every figure per token that 28 would have but the weights'), random weights. Peaks are
torch.cuda's allocated memory above the trainer before the step: `mb_peak_gib` up to AdamW's update (the
micro-batch's forward, recompute and backward), `step_peak_gib` with it.
Context and tensor parallelism (trainer.parallel cp / tp) need two GPUs or more: with one GPU (what a lent machine
has) the stage records that they were not run and why; their parity is tested on gloo in CI
(tests/integration/test_ulysses.py, test_tensor_parallel.py, test_trainer_tp_cp.py).
--quick on the CPU (CI's smoke run): trainer_long's --quick sizes (the 0.5B shape, one layer, 512 and 1024 tokens).

    python benchmarks/gpu/stage_h_long.py [--device cuda] [--quick] [--out DIR]   (bash benchmarks/gpu/run.sh h)
"""
from __future__ import annotations

import argparse
import sys

import report

sys.path.insert(0, str(report.HERE.parent / "speed"))  # trainer_long.py
import trainer_long  # noqa: E402

FULL = {"shape": "qwen2.5-7b", "layers": 4, "lengths": [8192, 16384, 32768], "dtype": "bfloat16"}


def run(args) -> dict:
    import torch

    sizes = {"shape": "qwen2.5-0.5b", "layers": 1, "lengths": [512, 1024], "dtype": "float32"} if args.quick else FULL
    gpus = torch.cuda.device_count() if str(args.device).startswith("cuda") else 0
    ns = argparse.Namespace(quick=False, device=str(args.device), max_gib=1e9, plot=None, **sizes)
    r = trainer_long.run(ns, args.work)
    parallel = {"cp": "not run", "tp": "not run",
                "why": f"{gpus} GPU(s) here: context and tensor parallelism need 2 or more (parity: gloo tests in CI)"}
    return {"title": "long answers: dense mask vs block mask", "quick": args.quick,
            "machine": report.machine(args.device),
            **{k: r[k] for k in ("shape", "layers", "dtype", "device", "rows", "skipped", "ratios")},
            "parallel": parallel}


def markdown(r: dict) -> str:
    rows = [("L", "attention", "micro-batch peak GiB", "step peak GiB", "s / 1k tokens")]
    rows += [(x["length"], x["attention"], x["mb_peak_gib"], x["step_peak_gib"], x["s_per_1k_tokens"])
             for x in r["rows"]]
    lines = [f"{r['shape']} shape, {r['layers']} layers, {r['dtype']}, gradient checkpointing", "",
             report.table(rows), ""]
    lines += [f"- `{k}` = {v}" for k, v in r["ratios"].items()]
    lines.append(f"- parallel: {r['parallel']['why']}")
    return "\n".join(lines)


if __name__ == "__main__":
    report.stage(__doc__, "h", run, markdown)
