"""Stage g: the FSDP2 trainer (world 1) on one GPU at the sizes users train, against a plain fwd+bwd+AdamW loop.

What it measures, per shape (Qwen2.5-1.5B and Qwen3-4B configs with seeded random weights built on the device,
areal_mq/engines/shapes.py; --quick: the tiny Qwen2 and Qwen3 shapes), one batch of G groups x 4 sequences of
P prompt + L generated tokens (full: 4 x 4 x (256 + 768)):
  - plain: HF model, bf16 autocast, cross-entropy forward + backward per micro-batch, one AdamW step;
  - fsdp: the trainer with trainer.strategy fsdp (bf16 MixedPrecisionPolicy, fp32 master + AdamW);
  - fsdp_ac: + activation checkpointing (trainer.gradient_checkpointing);
  - fsdp_offload: + trainer.fsdp.offload (parameters, gradients, AdamW state in host memory; step on the CPU);
tokens/s (median of the timed steps after a warm-up; the CPU smoke: one step, no warm-up) and peak device memory
(torch.cuda.max_memory_allocated).
Then a larger Qwen2.5 shape (3B) trained with offload + activation checkpointing; 7B with offload needs
~112 GiB of host memory for its fp32 state (the lent machine has 128 GiB), left to a bigger host.
Ratios: fsdp_vs_plain_tokens_per_s (target 0.5, the trainer's stage c target) and
plain_vs_fsdp_offload_peak_memory (how much device memory offload saves; reported).

    python benchmarks/gpu/stage_g_fsdp.py [--device cuda] [--quick] [--out DIR]
"""
from __future__ import annotations

import gc
import statistics
import time

import report
from report import common
from stage_c_trainer import batch, plain_step, rows_of

SIZES = {"groups": (2, 4), "group_size": (2, 4), "prompt": (8, 256), "gen": (24, 768), "budget": (64, 4096),
         "steps": (1, 2), "warmup": (1, 1)}  # quick, full; the CPU smoke times its one step without a warm-up
SHAPES = (("tiny-qwen2", "tiny-qwen3"), ("qwen2.5-1.5b", "qwen3-4b"))
# 3B only: a 7B with offload holds ~112 GiB of fp32 state in host memory, on a 128 GiB machine (docs/bigger-models.md)
LARGEST = (("tiny-qwen2",), ("qwen2.5-3b",))
TARGETS = {"fsdp_vs_plain_tokens_per_s": 0.5}
log = common.logger("gpu-g")


def _peak(device) -> float:
    import torch

    if torch.device(device).type != "cuda":
        return 0.0
    return round(torch.cuda.max_memory_allocated() / 2**30, 2)


def _reset(device) -> None:
    import torch

    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def _trainer_run(model_dir, args, s, full, **cfg) -> dict:
    from areal_mq.algorithms.config import TrainerConfig
    from areal_mq.algorithms.trainer import Trainer

    _reset(args.device)
    fsdp = {"offload": cfg.pop("offload", False)}
    trainer = Trainer(TrainerConfig(lr=1e-7, max_tokens_per_mb=s["budget"], strategy="fsdp", precision="bf16",
                                    fsdp=fsdp, **cfg), model_dir, device=args.device, engine_dtype="bfloat16")
    clock = report.timer(trainer.device)
    for _ in range(s["warmup"]):
        trainer.train_step(full)
    times = []
    for _ in range(s["steps"]):
        t0 = clock()
        trainer.train_step(full)
        times.append(clock() - t0)
    out = {"step_s": [round(t, 3) for t in times], "peak_gib": _peak(args.device)}
    del trainer
    return out


def _plain_run(model_dir, args, s, full) -> dict:
    import torch

    from areal_mq.engines.models import load_causal_lm

    _reset(args.device)
    model = load_causal_lm(model_dir, "float32", args.device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-7)
    rows = rows_of(full, model.device)
    per_mb = max(1, s["budget"] // rows.shape[1])
    clock = report.timer(args.device)
    for _ in range(s["warmup"]):  # AdamW state made here (in the CPU smoke, in the timed step)
        plain_step(model, optimizer, rows, per_mb, "bf16")
    times = []
    for _ in range(s["steps"]):
        t0 = clock()
        plain_step(model, optimizer, rows, per_mb, "bf16")
        times.append(clock() - t0)
    out = {"step_s": [round(t, 3) for t in times], "peak_gib": _peak(args.device)}
    del model, optimizer
    return out


def _guarded(fn, *a, **kw) -> dict:
    import torch

    try:
        return fn(*a, **kw)
    except torch.OutOfMemoryError as exc:
        return {"error": f"out of memory: {str(exc)[:160]}"}


def run(args) -> dict:
    from areal_mq.engines.shapes import build_random_model, parameter_count

    q = 0 if args.quick else 1
    s = {k: v[q] for k, v in SIZES.items()} | ({"warmup": 0} if report.cpu_smoke(args) else {})
    full = batch(s["groups"], s["group_size"], s["prompt"], s["gen"])
    tokens = sum(len(x.prompt_ids) + len(x.output_ids) for smp in full for x in smp.seqs)
    shapes = {}
    for name in SHAPES[q]:
        t0 = time.perf_counter()
        model_dir = build_random_model(args.work / f"shape-{name}", name, dtype="bfloat16", device=args.device)
        log(f"{name}: built in {time.perf_counter() - t0:.0f} s")
        runs = {"plain": _guarded(_plain_run, model_dir, args, s, full),
                "fsdp": _guarded(_trainer_run, model_dir, args, s, full),
                "fsdp_ac": _guarded(_trainer_run, model_dir, args, s, full, gradient_checkpointing=True),
                "fsdp_offload": _guarded(_trainer_run, model_dir, args, s, full, offload=True,
                                         gradient_checkpointing=True)}
        for r in runs.values():
            if "step_s" in r:
                r["tokens_per_s"] = round(tokens / statistics.median(r["step_s"]), 1)
        shapes[name] = {"params_b": round(parameter_count(name) / 1e9, 3), "runs": runs}
        log(f"{name}: " + ", ".join(f"{k} {v.get('tokens_per_s', v.get('error'))}" for k, v in runs.items()))
    largest = None
    for name in LARGEST[q]:
        model_dir = build_random_model(args.work / f"shape-{name}", name, dtype="bfloat16", device=args.device)
        got = _guarded(_trainer_run, model_dir, args, dict(s, steps=1), full, offload=True,
                       gradient_checkpointing=True)
        log(f"largest try {name}: {got}")
        if "error" in got:
            break
        largest = {"shape": name, "params_b": round(parameter_count(name) / 1e9, 3), **got}
    first = shapes[SHAPES[q][0]]["runs"]
    ratio = None
    if "tokens_per_s" in first["fsdp"] and "tokens_per_s" in first["plain"]:
        ratio = round(first["fsdp"]["tokens_per_s"] / first["plain"]["tokens_per_s"], 3)
    mem = None
    if first["fsdp_offload"].get("peak_gib") and first["plain"].get("peak_gib"):
        mem = round(first["plain"]["peak_gib"] / first["fsdp_offload"]["peak_gib"], 3)
    return {"title": "FSDP2 trainer (world 1) vs plain fwd+bwd+AdamW", "quick": args.quick,
            "machine": report.machine(args.device), "tokens_per_step": tokens, "budget": s["budget"],
            "shapes": shapes, "largest_with_offload": largest,
            "ratios": {"fsdp_vs_plain_tokens_per_s": ratio, "plain_vs_fsdp_offload_peak_memory": mem},
            "targets": TARGETS}


def markdown(r: dict) -> str:
    rows = [("shape", "loop", "tokens/s", "peak GiB", "step s")]
    for name, sh in r["shapes"].items():
        for k, v in sh["runs"].items():
            rows.append((f"{name} ({sh['params_b']}B)", k, v.get("tokens_per_s", v.get("error", "")),
                         v.get("peak_gib", ""), " ".join(str(t) for t in v.get("step_s", []))))
    big = r["largest_with_offload"]
    ratio, target = r["ratios"]["fsdp_vs_plain_tokens_per_s"], r["targets"]["fsdp_vs_plain_tokens_per_s"]
    return (report.table(rows) + f"\n\n{r['tokens_per_step']} tokens per step; largest Qwen2.5 shape trained with "
            f"offload + activation checkpointing: {big['shape'] if big else 'none'}"
            f"{' (peak %s GiB, step %s s)' % (big['peak_gib'], big['step_s']) if big else ''}; "
            f"fsdp/plain target >= {target}: {report.verdict(ratio, target)} ({ratio})")


def main() -> None:
    report.stage(__doc__, "g", run, markdown)


if __name__ == "__main__":
    main()
