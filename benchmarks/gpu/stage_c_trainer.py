"""Stage c: the trainer's tokens/s vs a plain fwd+bwd+AdamW loop of the same shape.

What it measures, on SmolLM2-135M's exact config with random weights (random_model.py; speed only): one batch of
G groups x 4 sequences of P prompt + L generated tokens (full: 8 x 4 x (128 + 384) = 32 x 512, the shape of the
issue's reference loop) trained by
  - the trainer (areal_mq/algorithms/trainer.py: decoupled PPO, proximal logprobs, packing into micro-batches
    of `budget` tokens, Accelerate; bf16 autocast over fp32 master weights, as the trainer of a bf16 engine),
    with its default shared-prompt packing and with dynamic packing, and
  - a plain loop: the same rows in micro-batches of the same token budget, cross-entropy forward + backward,
    one AdamW step, under the precision the trainer chose.
Each is timed over several steps after a warm-up (medians); the ratio trainer/plain is the headline.
Target (issue 25): the trainer within 2x of the plain loop (ratio >= 0.5). The step-time-vs-tokens points
(train_s per step at 1/4, 1/2 and all of the batch) feed the simulator's timing slot (fit_sim.py).

    python benchmarks/gpu/stage_c_trainer.py [--device cuda] [--quick] [--out DIR]
"""
from __future__ import annotations

import statistics

import numpy as np

import report
from report import common

SIZES = {"groups": (2, 8), "group_size": (2, 4), "prompt": (8, 128), "gen": (24, 384), "budget": (64, 8192),
         "steps": (2, 5)}  # quick, full
TARGETS = {"trainer_vs_plain_tokens_per_s": 0.5}
log = common.logger("gpu-c")


def batch(groups: int, size: int, prompt: int, gen: int, seed: int = 0) -> list:
    from areal_mq.messages import Sample, SeqSample

    rng = np.random.default_rng(seed)
    out = []
    for g in range(groups):
        p = rng.integers(100, 49000, prompt, dtype=np.int32)
        seqs = [SeqSample(prompt_ids=p, output_ids=rng.integers(100, 49000, gen, dtype=np.int32),
                          logprobs=np.full(gen, -8.0, np.float32), versions=np.zeros(gen, np.int32),
                          reward=float(i % 2)) for i in range(size)]
        out.append(Sample(sample_id=f"c{g}", seqs=seqs))
    return out


def rows_of(samples: list, device) -> "torch.Tensor":
    import torch

    ids = [np.concatenate([s.prompt_ids, s.output_ids]) for smp in samples for s in smp.seqs]
    return torch.tensor(np.stack(ids), dtype=torch.long, device=device)


def plain_step(model, optimizer, rows, per_mb: int, precision: str) -> None:
    import torch
    import torch.nn.functional as F

    for b in range(0, rows.shape[0], per_mb):
        ids = rows[b:b + per_mb]
        with torch.autocast(rows.device.type, dtype=torch.bfloat16, enabled=precision == "bf16"):
            logits = model(ids).logits
        loss = F.cross_entropy(logits[:, :-1].float().flatten(0, 1), ids[:, 1:].flatten())
        loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def run(args) -> dict:
    import torch

    from areal_mq.algorithms.config import TrainerConfig
    from areal_mq.algorithms.trainer import Trainer
    from areal_mq.engines.models import load_causal_lm
    from random_model import build, describe

    q = 0 if args.quick else 1
    s = {k: v[q] for k, v in SIZES.items()}
    model_dir = build(args.work / ("smollm2-random-quick" if args.quick else "smollm2-random"), args.quick,
                      report.PACK / "smollm2")
    full = batch(s["groups"], s["group_size"], s["prompt"], s["gen"])
    base = TrainerConfig(lr=1e-7, max_tokens_per_mb=s["budget"])
    # the bf16 engine's trainer (trainer.precision auto follows the engine's dtype): bf16 autocast, as the plain loop
    trainer = Trainer(base, model_dir, device=args.device, engine_dtype="bfloat16")
    clock = report.timer(trainer.device)
    trainer.train_step(batch(1, 2, 8, 8, seed=1))  # warm-up: allocator, kernels
    results = {}
    for packing in ("shared", "dynamic"):
        trainer.cfg = base.model_copy(update={"packing": packing})
        trainer.train_step(full)
        times = []
        for _ in range(s["steps"]):
            t0 = clock()
            trainer.train_step(full)
            times.append(clock() - t0)
        results[f"trainer_{packing}"] = times
    scaling = []  # step time vs tokens: a quarter, half and all of the batch (default packing)
    trainer.cfg = base
    for frac in (4, 2, 1):
        part = full[:max(1, len(full) // frac)]
        t0 = clock()
        trainer.train_step(part)
        scaling.append({"tokens": sum(len(x.prompt_ids) + len(x.output_ids) for smp in part for x in smp.seqs),
                        "step_s": round(clock() - t0, 4)})
    precision = trainer.precision
    del trainer
    model = load_causal_lm(model_dir, "float32", args.device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-7)
    rows = rows_of(full, model.device)
    per_mb = max(1, s["budget"] // rows.shape[1])
    plain_step(model, optimizer, rows[:1], 1, precision)  # warm-up
    times = []
    for _ in range(s["steps"]):
        t0 = clock()
        plain_step(model, optimizer, rows, per_mb, precision)
        times.append(clock() - t0)
    results["plain"] = times
    tokens = int(rows.numel())
    tps = {k: round(tokens / statistics.median(v), 1) for k, v in results.items()}
    for k, v in tps.items():
        log(f"{k}: {v:.0f} tok/s")
    return {"title": "trainer vs plain fwd+bwd+AdamW", "quick": args.quick, "machine": report.machine(args.device),
            "model": describe(model_dir, args.quick), "precision": precision, "rows": int(rows.shape[0]),
            "row_tokens": int(rows.shape[1]), "tokens_per_step": tokens, "budget": s["budget"],
            "plain_rows_per_mb": per_mb, "step_s": {k: [round(t, 4) for t in v] for k, v in results.items()},
            "tokens_per_s": tps, "train_scaling": scaling,
            "ratios": {"trainer_vs_plain_tokens_per_s": round(tps["trainer_shared"] / tps["plain"], 3),
                       "trainer_dynamic_vs_plain_tokens_per_s": round(tps["trainer_dynamic"] / tps["plain"], 3)},
            "targets": TARGETS}


def markdown(r: dict) -> str:
    plain = r["tokens_per_s"]["plain"]
    rows = [("loop", "tokens/s", "vs plain", "step s (each)")]
    rows += [(k, v, f"{v / plain:.2f}", " ".join(f"{t:.3f}" for t in r["step_s"][k])) for k, v in r["tokens_per_s"].items()]
    ratio, target = r["ratios"]["trainer_vs_plain_tokens_per_s"], r["targets"]["trainer_vs_plain_tokens_per_s"]
    return (report.table(rows) + f"\n\n{r['rows']} x {r['row_tokens']} tokens per step, budget {r['budget']} tokens "
            f"per micro-batch, precision {r['precision']}; target trainer/plain >= {target}: "
            f"{report.verdict(ratio, target)} ({ratio:.2f})")


def main() -> None:
    report.stage(__doc__, "c", run, markdown)


if __name__ == "__main__":
    main()
