"""Trainer benchmark, FSDP2 units: the root holding embeddings + norm + head vs units of their own, per-rank peak.

What it measures, in one run: the same 2-rank FSDP2 trainer (trainer.strategy fsdp, gloo, CPU, fp32, one torch thread
per rank, under torch.distributed.run) trains the same batches twice, each side a fresh launch:
  - before: `shard_policy(..., root_units=False)`, the old layout: the untied input embeddings, the final norm and
    the LM head are the root's group, gathered from the first forward to the end of the backward with both full
    gradients (the worker wraps areal_mq.algorithms.fsdp.shard_policy: the only caller of that flag);
  - after: the trainer as it ships (fsdp.vocab_units): the embeddings one unit (resharded after forward), norm +
    head another, gathered one at a time.
The model is a small Qwen2 shape with a large vocabulary for its width (untied, so the root matters: quick 49,152 x
128, full 65,536 x 256; areal_mq/engines/shapes.py tiny-qwen2 widened, seeded random weights built locally).
Memory is each rank's resident set (Linux VmHWM): torch keeps no allocator counters for CPU tensors. glibc's mmap
threshold is fixed at 1 MiB (as trainer_fsdp.py) so a freed tensor leaves the RSS at once and the peak follows the
live tensors; the high-water mark is reset after the trainer is built (/proc/self/clear_refs, as trainer_lora.py)
so it covers the steps alone; and the rank's RSS after its imports (torch, transformers, the trainer's modules:
the plan's TORCH_BASE, not the model) is subtracted. Headline `fsdp_root_units_rank_peak` = before / after of the
largest rank's step peak above its imports (target >= 1.15); `..._rss` the same on the whole resident sets.
Beside it, the plan's prediction (areal_mq/launch/plan.py trainer_rank, the same shape, ranks, precision,
max_tokens_per_mb and logprob_chunk_mb, TORCH_BASE left out on both sides): after = its items; before = the same
with the vocabulary-sized item counted twice (the old root gathered both matrices with their gradients), and the
gap measured / predicted - 1 (the issue asks for within 25 %). The losses of the two sides must be equal (parity).

    python benchmarks/speed/trainer.py --root [--quick] [--json PATH]
    (or python benchmarks/speed/trainer_root.py [--quick] [--json PATH])
--quick: the smaller shape, 1 step: about a minute on 2 cores.
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
TARGETS = {"fsdp_root_units_rank_peak": 1.15}
SIDES = ("before", "after")
WORLD = 2
VOCAB_ITEM = "gathered embeddings or head + its gradient"  # launch/plan.py trainer_rank's item
SIZES = {"vocab": (49152, 65536), "hidden": (128, 256), "intermediate": (256, 512), "layers": (2, 4),
         "heads": (4, 8), "groups": (1, 2), "group_size": (2, 4), "prompt": (16, 32), "gen": (48, 96),
         "steps": (1, 2), "chunk_mb": (16, 32)}  # quick, full
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": str(2**20)}
log = common.logger("trainer-root")


def status_gib(field: str) -> float:
    """A /proc/self/status memory field (VmRSS, VmHWM) in GiB."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":")) / 2**20


def trainer_config(s: dict) -> dict:
    tokens = s["groups"] * s["group_size"] * (s["prompt"] + s["gen"])
    return {"strategy": "fsdp", "precision": "fp32", "lr": 1e-6, "seed": 1, "checkpoint_every": 0,
            "max_tokens_per_mb": tokens // WORLD, "fsdp": {"logprob_chunk_mb": s["chunk_mb"]}}


def worker(model_dir: str, side: str, sizes: dict, out: str) -> None:
    """One rank of one side: build the fsdp trainer (the old root layout for `before`), train `steps` batches."""
    import functools

    import torch
    from torch.distributed.fsdp import FSDPModule

    from areal_mq.algorithms import fsdp
    from areal_mq.algorithms.config import TrainerConfig
    from areal_mq.algorithms.trainer import Trainer
    from trainer_fsdp import batches

    torch.set_num_threads(1)
    if side == "before":  # FsdpStrategy.build looks shard_policy up at call time
        fsdp.shard_policy = functools.partial(fsdp.shard_policy, root_units=False)
    imports = status_gib("VmRSS")
    trainer = Trainer(TrainerConfig(**trainer_config(sizes)), model_dir, device="cpu")
    built = status_gib("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # the high-water mark from here on: the steps alone
    steps, losses = [], []
    for b in batches(sizes["steps"], sizes):  # token ids up to 49,000: the vocabularies are larger
        t0 = time.perf_counter()
        losses.append(trainer.train_step(b)["loss"])
        steps.append(time.perf_counter() - t0)
    lm = trainer.unwrapped
    Path(out, f"{side}-rank{trainer.rank}.json").write_text(json.dumps({
        "rss_imports_gib": round(imports, 4), "rss_built_gib": round(built, 4),
        "step_peak_gib": round(status_gib("VmHWM"), 4), "step_s": [round(t, 2) for t in steps], "losses": losses,
        "own_units": [isinstance(m, FSDPModule) for m in (lm.model.embed_tokens, lm.model.norm, lm.lm_head)]}))


def predicted(path: Path, s: dict) -> dict:
    """The plan's trainer rank for this run without TORCH_BASE: after (as it plans now) and before (the old root)."""
    from areal_mq.config import config_from_dict
    from areal_mq.launch.plan import GIB, make_plan

    plan = make_plan(config_from_dict({"model": {"name": str(path), "device": "cpu"}, "trainer": trainer_config(s),
                                       "launcher": {"trainer_ranks": WORLD}}))
    items = {i.name: i.nbytes for i in plan.processes[0].items}
    after = sum(items.values())
    before = after + (0 if plan.shape.tied else items[VOCAB_ITEM])
    return {"after_gib": round(after / GIB, 4), "before_gib": round(before / GIB, 4),
            "vocab_unit_gib": round(items[VOCAB_ITEM] / GIB, 4),
            "items_gib": {k: round(v / GIB, 4) for k, v in items.items()}}


def launch(path: Path, side: str, s: dict, out: str) -> list[dict]:
    env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{HERE}{os.pathsep}{HERE.parent}", OMP_NUM_THREADS="1",
               CUDA_VISIBLE_DEVICES="", HF_HUB_OFFLINE="1", **MALLOC_ENV)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(WORLD), "--master_addr",
           "127.0.0.1", "--master_port", str(common.free_ports(1)[0]), __file__, "--worker", str(path),
           "--side", side, "--out", out, "--sizes", json.dumps(s)]
    proc = subprocess.run(cmd, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=3000)
    if proc.returncode != 0:
        raise SystemExit(f"side {side} failed:\n{proc.stdout[-3000:]}")
    return [json.loads(Path(out, f"{side}-rank{r}.json").read_text()) for r in range(WORLD)]


def run(args: argparse.Namespace) -> dict:
    from areal_mq.engines.shapes import build_random_model

    q = 0 if args.quick else 1
    s = {k: v[q] for k, v in SIZES.items()}
    shape = dict(vocab_size=s["vocab"], hidden_size=s["hidden"], intermediate_size=s["intermediate"],
                 num_hidden_layers=s["layers"], num_attention_heads=s["heads"], num_key_value_heads=s["heads"] // 2,
                 head_dim=s["hidden"] // s["heads"], tie_word_embeddings=False)
    cache = Path(os.environ.get("AREAL_MQ_CACHE", Path.home() / ".cache" / "areal-mq")) / "bench-models"
    path = build_random_model(cache / f"qwen2-untied-v{s['vocab']}-h{s['hidden']}-l{s['layers']}", "tiny-qwen2",
                              seed=0, **shape)
    plan = predicted(path, s)
    results = []
    with tempfile.TemporaryDirectory(prefix="bench-root-") as out:
        for side in SIDES:
            t0 = time.perf_counter()
            ranks = launch(path, side, s, out)
            above = [r["step_peak_gib"] - r["rss_imports_gib"] for r in ranks]
            results.append({"name": side, "own_units": ranks[0]["own_units"],
                            "rank_step_peak_gib": [r["step_peak_gib"] for r in ranks],
                            "rank_imports_gib": [r["rss_imports_gib"] for r in ranks],
                            "rank_above_imports_gib": [round(a, 4) for a in above],
                            "plan_gib": plan[f"{side}_gib"], "step_s": ranks[0]["step_s"],
                            "losses": ranks[0]["losses"]})
            log(f"{side}: rank peaks above imports {[round(a, 3) for a in above]} GiB, plan {plan[side + '_gib']} "
                f"GiB ({time.perf_counter() - t0:.0f} s)")
    before, after = results
    measured = max(before["rank_above_imports_gib"]) / max(after["rank_above_imports_gib"])
    expected = plan["before_gib"] / plan["after_gib"]
    return {"benchmark": "trainer_root", "quick": args.quick, "machine": common.torch_machine(device="cpu"),
            "env": MALLOC_ENV, "world": WORLD, "sizes": s, "model": {"shape": "tiny-qwen2", **shape},
            "plan": plan, "results": results,
            "loss_max_abs_diff": max(abs(a - b) for a, b in zip(before["losses"], after["losses"])),
            "ratios": {"fsdp_root_units_rank_peak": round(measured, 3),
                       "fsdp_root_units_rank_peak_rss": round(max(before["rank_step_peak_gib"])
                                                              / max(after["rank_step_peak_gib"]), 3),
                       "plan_root_units_rank_peak": round(expected, 3),
                       "measured_vs_plan": round(measured / expected, 3)},
            "targets": dict(TARGETS)}


def table(r: dict, command: str) -> str:
    rows = [("side", "own units (embed, norm, head)", "rank step peak GiB", "above imports GiB", "plan GiB (gap)",
             "losses")]
    for x in r["results"]:
        top = max(x["rank_above_imports_gib"])
        rows.append((x["name"], " ".join("yes" if u else "no" for u in x["own_units"]),
                     " / ".join(f"{v:.3f}" for v in x["rank_step_peak_gib"]),
                     " / ".join(f"{v:.3f}" for v in x["rank_above_imports_gib"]),
                     f"{x['plan_gib']:.3f} ({top / x['plan_gib'] - 1:+.0%})", " ".join(f"{v:.6f}" for v in x["losses"])))
    s, m = r["sizes"], r["model"]
    agree = abs(r["ratios"]["measured_vs_plan"] - 1) <= 0.25
    note = (f"untied Qwen2 shape: vocabulary {m['vocab_size']} x hidden {m['hidden_size']}, {m['num_hidden_layers']} "
            f"layers; {WORLD} ranks over gloo, fp32, {s['steps']} step(s) of "
            f"{s['groups'] * s['group_size'] * (s['prompt'] + s['gen'])} tokens; loss max |diff| "
            f"{r['loss_max_abs_diff']:.1e}; measured ratio within 25 % of the plan's: {'yes' if agree else 'NO'}; "
            f"load avg {r['machine']['loadavg_at_start'][0]:.1f}")
    return "\n".join([*common.align(rows), "", *common.align(common.ratio_rows(r)), note, f"command: {command}"])


def main() -> None:
    parser = common.arg_parser(__doc__, quick_help="The smaller shape, 1 step: about a minute on 2 cores.")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--side", help=argparse.SUPPRESS)
    parser.add_argument("--sizes", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        sys.path.insert(0, str(REPO))
        worker(args.worker, args.side, json.loads(args.sizes), args.out)
        return
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    report = common.timed(run, args)
    command = " ".join(["python benchmarks/speed/trainer.py --root", *sys.argv[1:]])  # trainer.py drops --root
    common.finish(report, args.json, table(report, command))


if __name__ == "__main__":
    main()
