"""Trainer benchmark, LoRA: full fine-tuning vs a rank-16 all-linear adapter (trainer.lora), peak memory side by side.

What it measures, per model (full: SmolLM2-135M-Instruct's real weights and the Qwen2.5-0.5B shape, its public config
with seeded random weights saved in bf16 as models ship, areal_mq/engines/shapes.py; --quick: the tiny random Llama)
and per precision (fp32: trainer.precision auto under the CPU quickstart's fp32 engine; bf16: auto under a bf16
engine, the GPU configs'), the SAME batch (2 groups x 4 x (32 prompt + 96 generated) = 1,024 tokens, one micro-batch
at the default trainer.max_tokens_per_mb) trained for a few steps by:
  - full: every weight trains (fp32 master weights, gradients and AdamW: 16 bytes per parameter; bf16 = autocast);
  - lora: trainer.lora with its defaults (rank 16, alpha 32, all-linear; areal_mq/algorithms/lora.py): the base
    frozen in the precision's dtype (fp32 or bf16), the adapter and its AdamW state in fp32.
Each (model, precision, way) runs in a fresh process (strategy ddp, world 1, one torch thread by default), so no peak
carries over. Memory is the process's resident set (Linux VmHWM / ru_maxrss): torch keeps no allocator counters for
CPU tensors, and RSS counts everything the process holds (weights, gradients, AdamW state, activations, logits, the
checkpoint's pages while it is read, and the libraries). glibc's mmap threshold is fixed at 1 MiB (as
trainer_fsdp.py), so freed tensors leave the RSS at once and the peak follows the live tensors. Reported per process:
RSS after the imports, the load peak (building the trainer), the step peak (the high-water mark reset after building,
via /proc/self/clear_refs, so it covers the steps alone, AdamW's first allocation included) and the process peak (the
larger: what the machine must have). Step time: the median of the steps after the first (the first allocates AdamW).
Headline ratio `full_vs_lora_rank_memory` = full's process peak / LoRA's on the 0.5B shape in bf16 (target >= 2.5);
the same for fp32 and for SmolLM2 (suffixed), `..._step` (step peaks only) and `full_vs_lora_step_time` (full's step
time / LoRA's: > 1 when LoRA is faster). The plan check: `areal-mq plan`'s trainer figures (areal_mq/launch/plan.py:
training peak and load peak, each with its 0.4 GiB torch base) for the same shape, precision and max_tokens_per_mb,
beside the measured peaks, with the gap (measured / predicted - 1).

    python benchmarks/speed/trainer.py --lora [--quick] [--json PATH] [--threads N]
    (or python benchmarks/speed/trainer_lora.py ...)

--quick: the tiny random Llama in bf16 only, a 128-token batch, 2 steps: seconds per process, the same code path.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py (it adds the kinds' folders)
import common  # noqa: E402

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
TARGETS = {"full_vs_lora_rank_memory": 2.5}
WAYS = ("full", "lora")
SIZES = {"models": (("tiny-random-llama",), ("qwen2.5-0.5b", "smollm2-135m-instruct")),
         "precisions": (("bf16",), ("fp32", "bf16")), "groups": (1, 2), "group_size": (2, 4), "prompt": (16, 32),
         "gen": (48, 96), "steps": (2, 2), "budget": (1024, 1024)}
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": str(2**20)}
TAGS = {"qwen2.5-0.5b": "", "smollm2-135m-instruct": "_smollm2", "tiny-random-llama": ""}
log = common.logger("trainer-lora")


def status_gib(field: str) -> float:
    """A /proc/self/status memory field (VmRSS, VmHWM) in GiB."""
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith(field + ":")) / 2**20


def worker(model_dir: str, way: str, precision: str, sizes: dict, threads: int, out: str) -> None:
    """One measured process: build the trainer (full or LoRA) in `precision`, train the batch `steps` times."""
    import peft  # noqa: F401  (imported before the baseline, in both ways: the libraries are not the model)
    import torch

    from areal_mq.algorithms.config import LoraConfig, TrainerConfig
    from areal_mq.algorithms.trainer import Trainer
    from trainer_fsdp import batches

    torch.set_num_threads(threads)
    imports = status_gib("VmRSS")
    cfg = TrainerConfig(lr=1e-6, max_tokens_per_mb=sizes["budget"], seed=1, checkpoint_every=0, precision=precision,
                        lora=LoraConfig() if way == "lora" else None)
    t0 = time.perf_counter()
    trainer = Trainer(cfg, model_dir, device="cpu")
    load_s = time.perf_counter() - t0
    load_peak, built = status_gib("VmHWM"), status_gib("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # the high-water mark from here on: the steps alone
    steps, losses = [], []
    for b in batches(sizes["steps"], sizes):
        t0 = time.perf_counter()
        losses.append(trainer.train_step(b)["loss"])
        steps.append(time.perf_counter() - t0)
    params = list(trainer.unwrapped.parameters())
    Path(out).write_text(json.dumps({
        "rss_imports_gib": round(imports, 3), "load_peak_gib": round(load_peak, 3), "rss_built_gib": round(built, 3),
        "step_peak_gib": round(status_gib("VmHWM"), 3), "load_s": round(load_s, 2),
        "step_s": [round(t, 2) for t in steps], "losses": losses, "params": sum(p.numel() for p in params),
        "trainable": sum(p.numel() for p in params if p.requires_grad), "precision": trainer.precision,
        "base_dtype": str(next(p.dtype for p in params if not p.requires_grad) if way == "lora" else params[0].dtype)}))


def model_dir(name: str) -> Path:
    """A model name the cache resolves, or a public shape built with seeded random weights saved in bf16."""
    from areal_mq.engines.models import resolve_model
    from areal_mq.engines.shapes import SHAPES, build_random_model

    if name in SHAPES:
        cache = Path(os.environ.get("AREAL_MQ_CACHE", Path.home() / ".cache" / "areal-mq")) / "bench-models"
        return build_random_model(cache / f"{name}-random-bf16", name, seed=0, dtype="bfloat16")
    return resolve_model(name)


def measure(path: Path, way: str, precision: str, s: dict, threads: int) -> dict:
    env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{HERE}{os.pathsep}{HERE.parent}",
               OMP_NUM_THREADS=str(threads), CUDA_VISIBLE_DEVICES="", HF_HUB_OFFLINE="1", **MALLOC_ENV)
    with tempfile.TemporaryDirectory(prefix="bench-lora-") as tmp:
        out = Path(tmp, "r.json")
        cmd = [sys.executable, __file__, "--worker", str(path), "--way", way, "--precision", precision,
               "--sizes", json.dumps(s), "--threads", str(threads), "--out", str(out)]
        proc = subprocess.run(cmd, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              timeout=3000)
        if proc.returncode != 0:
            raise SystemExit(f"{way} {precision} on {path.name} failed:\n{proc.stdout[-3000:]}")
        r = json.loads(out.read_text())
    r["peak_gib"] = max(r["load_peak_gib"], r["step_peak_gib"])
    later = sorted(r["step_s"][1:] or r["step_s"])
    r["step_time_s"] = later[len(later) // 2]
    return r


def predicted(path: Path, way: str, precision: str, budget: int) -> dict:
    """`areal-mq plan`'s trainer rank for this run: training peak, load peak and the larger, in GiB."""
    from areal_mq.config import config_from_dict
    from areal_mq.launch.plan import GIB, TORCH_BASE, make_plan

    trainer = {"precision": precision, "max_tokens_per_mb": budget, **({"lora": {}} if way == "lora" else {})}
    plan = make_plan(config_from_dict({"model": {"name": str(path), "device": "cpu"}, "trainer": trainer}))
    rank = plan.processes[0]
    return {"train_gib": round(rank.nbytes / GIB, 3), "load_gib": round((TORCH_BASE + rank.load["host"]) / GIB, 3),
            "peak_gib": round(rank.peak("host") / GIB, 3),
            "items_gib": {i.name: round(i.nbytes / GIB, 3) for i in rank.items}}


def run(args: argparse.Namespace) -> dict:
    q = 0 if args.quick else 1
    s = {k: v[q] for k, v in SIZES.items() if k not in ("models", "precisions")}
    results, ratios = [], {}
    for name in SIZES["models"][q]:
        path = model_dir(name)
        for precision in SIZES["precisions"][q]:
            row = {"model": name, "precision": precision}
            for way in WAYS:
                t0 = time.perf_counter()
                row[way] = measure(path, way, precision, s, args.threads)
                row[way]["plan"] = predicted(path, way, precision, s["budget"])
                log(f"{name} {precision} {way}: peak {row[way]['peak_gib']} GiB (load {row[way]['load_peak_gib']}, "
                    f"steps {row[way]['step_peak_gib']}), plan {row[way]['plan']['peak_gib']} GiB, step "
                    f"{row[way]['step_time_s']} s ({time.perf_counter() - t0:.0f} s)")
            results.append(row)
            full, lora = row["full"], row["lora"]
            tag = TAGS.get(name, "_" + name) + ("" if precision == "bf16" else "_fp32")
            ratios[f"full_vs_lora_rank_memory{tag}"] = round(full["peak_gib"] / lora["peak_gib"], 3)
            ratios[f"full_vs_lora_rank_memory_step{tag}"] = round(full["step_peak_gib"] / lora["step_peak_gib"], 3)
            ratios[f"full_vs_lora_step_time{tag}"] = round(full["step_time_s"] / lora["step_time_s"], 3)
    tokens = s["groups"] * s["group_size"] * (s["prompt"] + s["gen"])
    return {"benchmark": "trainer_lora", "quick": args.quick, "machine": common.torch_machine(device="cpu"),
            "env": MALLOC_ENV, "threads": args.threads, "sizes": {**s, "tokens_per_step": tokens}, "lora": {
                "rank": 16, "alpha": 32.0, "target_modules": "all-linear"}, "results": results, "ratios": ratios,
            "targets": dict(TARGETS)}


def table(r: dict, command: str) -> str:
    rows = [("model", "prec", "way", "params (trainable)", "peak GiB", "load peak", "step peak", "after imports",
             "plan peak (gap)", "plan train (gap)", "step s")]
    for row in r["results"]:
        for way in WAYS:
            x, p = row[way], row[way]["plan"]
            rows.append((row["model"], row["precision"], way, f"{x['params'] / 1e6:.1f}M ({x['trainable'] / 1e6:.2f}M)",
                         x["peak_gib"], x["load_peak_gib"], x["step_peak_gib"], x["rss_imports_gib"],
                         f"{p['peak_gib']} ({x['peak_gib'] / p['peak_gib'] - 1:+.0%})",
                         f"{p['train_gib']} ({x['step_peak_gib'] / p['train_gib'] - 1:+.0%})", x["step_time_s"]))
    s = r["sizes"]
    note = (f"same batch for all: {s['tokens_per_step']} tokens/step, max_tokens_per_mb {s['budget']}, {s['steps']} "
            f"steps, {r['threads']} thread(s); LoRA rank 16 all-linear; gap = measured / plan - 1; load avg "
            f"{r['machine']['loadavg_at_start'][0]:.1f}")
    return "\n".join([*common.align(rows), "", *common.align(common.ratio_rows(r)), note, f"command: {command}"])


def main() -> None:
    parser = common.arg_parser(__doc__, quick_help="The tiny random Llama, 128 tokens, 2 steps: seconds a process.")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process (trainer.py's docstring).")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--way", help=argparse.SUPPRESS)
    parser.add_argument("--precision", help=argparse.SUPPRESS)
    parser.add_argument("--sizes", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        sys.path.insert(0, str(REPO))
        worker(args.worker, args.way, args.precision, json.loads(args.sizes), args.threads, args.out)
        return
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    report = common.timed(run, args)
    command = " ".join(["python benchmarks/speed/trainer.py --lora", *sys.argv[1:]])  # trainer.py drops --lora
    common.finish(report, args.json, table(report, command))


if __name__ == "__main__":
    main()
