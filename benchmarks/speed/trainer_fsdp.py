"""Trainer benchmark, sharded: one process holding the whole model vs 2 FSDP2 ranks over gloo, same batches.

What it measures, in one run, on a Qwen2.5-0.5B-shaped model (its public config, seeded random weights built
here: areal_mq/engines/shapes.py; --quick: a 6-layer cut of it, same widths and vocabulary):
  - single: the plain trainer (strategy ddp, world 1) in its own process;
  - fsdp2: 2 ranks under torch.distributed.run with trainer.strategy fsdp;
both train the same S batches (fp32, the trainer's defaults otherwise), one torch thread per process. Each
process reports its peak RSS (ru_maxrss), step times and losses. Headline ratio `single_vs_fsdp2_rank_memory`
= single peak / largest rank's peak (target >= 1.6 at world 2: the 16 bytes per parameter of weights, gradients
and AdamW state halve, while each rank keeps its own activations, one gathered layer and the root's gathered
embeddings). Also reported: tokens/s of each (world-2 tokens/s counts the whole batch per step wall time) and the
largest loss difference (parity; the parity TEST is tests/integration/test_trainer_fsdp.py).

    python benchmarks/speed/trainer.py --strategy fsdp --world 2 [--quick] [--json PATH]
    (or python benchmarks/speed/trainer_fsdp.py [--quick] [--json PATH] [--world 2])
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py (it adds the kinds' folders)
import common  # noqa: E402

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
TARGETS = {"single_vs_fsdp2_rank_memory": 1.6}
SIZES = {"layers": (6, 24), "groups": (2, 4), "group_size": (2, 4), "prompt": (32, 32), "gen": (96, 96),
         "steps": (2, 2), "budget": (512, 2048)}  # quick, full (full: 2,048 tokens a step, ~15 min on 2 cores)
# glibc's dynamic mmap threshold (up to 32 MiB) keeps freed tensors below it in the heap, so a process's peak RSS
# also records its allocation history (measured: +0.9 GiB per FSDP rank from the gathered layers' buffers, which
# are freed and made again every layer). Both sides run with a fixed 1 MiB threshold, so peak RSS follows the
# live tensors: the figure that carries over to a GPU's caching allocator.
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": str(2**20)}
log = common.logger("trainer-fsdp")


def batches(n: int, s: dict) -> list:
    import numpy as np

    from areal_mq.messages import Sample, SeqSample

    out = []
    for i in range(n):
        rng = np.random.default_rng(100 + i)
        step = []
        for g in range(s["groups"]):
            prompt = rng.integers(100, 49000, s["prompt"], dtype=np.int32)
            seqs = [SeqSample(prompt_ids=prompt, output_ids=rng.integers(100, 49000, s["gen"], dtype=np.int32),
                              logprobs=np.full(s["gen"], -11.0, np.float32), versions=np.full(s["gen"], i, np.int32),
                              reward=float(k % 2)) for k in range(s["group_size"])]
            step.append(Sample(sample_id=f"b{i}-{g}", seqs=seqs))
        out.append(step)
    return out


def worker(model_dir: str, strategy: str, sizes: dict, out: str) -> None:
    """Body of one measured process (single, or one FSDP rank)."""
    import torch

    from areal_mq.algorithms.config import TrainerConfig
    from areal_mq.algorithms.trainer import Trainer

    torch.set_num_threads(1)
    trainer = Trainer(TrainerConfig(strategy=strategy, lr=1e-6, max_tokens_per_mb=sizes["budget"], seed=1,
                                    checkpoint_every=0), model_dir, device="cpu")
    steps, losses = [], []
    for b in batches(sizes["steps"], sizes):
        t0 = time.perf_counter()
        losses.append(trainer.train_step(b)["loss"])
        steps.append(time.perf_counter() - t0)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB -> GiB
    Path(out, f"{strategy}-rank{trainer.rank}.json").write_text(json.dumps(
        {"peak_rss_gib": round(rss, 3), "step_s": [round(t, 2) for t in steps], "losses": losses,
         "world": trainer.world_size}))


def _run(cmd: list[str], env: dict) -> None:
    proc = subprocess.run(cmd, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=3000)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd[:4])} failed:\n{proc.stdout[-3000:]}")


def run(args: argparse.Namespace) -> dict:
    from areal_mq.engines.shapes import build_random_model, parameter_count

    q = 0 if args.quick else 1
    s = {k: v[q] for k, v in SIZES.items()}
    model_dir = build_random_model(Path(args.work) / f"qwen2.5-0.5b-l{s['layers']}", "qwen2.5-0.5b",
                                   num_hidden_layers=s["layers"])
    n_params = parameter_count("qwen2.5-0.5b", num_hidden_layers=s["layers"])
    env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{HERE}{os.pathsep}{HERE.parent}", OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="",
               HF_HUB_OFFLINE="1", **MALLOC_ENV)
    out = tempfile.mkdtemp(prefix="bench-fsdp-")
    body = [__file__, "--worker", str(model_dir), "--out", out, "--sizes", json.dumps(s)]
    t0 = time.perf_counter()
    _run([sys.executable] + body + ["--strategy", "ddp"], env)
    log(f"single done in {time.perf_counter() - t0:.0f} s")
    t0 = time.perf_counter()
    _run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(args.world), "--master_addr",
          "127.0.0.1", "--master_port", str(common.free_ports(1)[0])] + body + ["--strategy", "fsdp"], env)
    log(f"fsdp world {args.world} done in {time.perf_counter() - t0:.0f} s")
    single = json.loads(Path(out, "ddp-rank0.json").read_text())
    ranks = [json.loads(Path(out, f"fsdp-rank{r}.json").read_text()) for r in range(args.world)]
    tokens = s["groups"] * s["group_size"] * (s["prompt"] + s["gen"])
    med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    rank_peak = max(r["peak_rss_gib"] for r in ranks)
    fsdp_step = med([max(r["step_s"][i] for r in ranks) for i in range(s["steps"])])
    results = [{"name": "single", "peak_rss_gib": single["peak_rss_gib"], "step_s": single["step_s"],
                "tokens_per_s": round(tokens / med(single["step_s"]), 1), "losses": single["losses"]},
               {"name": f"fsdp{args.world}", "rank_peak_rss_gib": [r["peak_rss_gib"] for r in ranks],
                "step_s": ranks[0]["step_s"], "tokens_per_s": round(tokens / fsdp_step, 1),
                "losses": ranks[0]["losses"]}]
    gap = max(abs(a - b) for a, b in zip(single["losses"], ranks[0]["losses"]))
    return {"benchmark": "trainer_fsdp", "quick": args.quick, "machine": common.torch_machine(device="cpu"),
            "env": MALLOC_ENV,
            "model": {"shape": "qwen2.5-0.5b", "layers": s["layers"], "params": n_params,
                      "fp32_state_gib": round(16 * n_params / 2**30, 2)},
            "sizes": s, "world": args.world, "results": results, "loss_max_abs_diff": gap,
            "ratios": {"single_vs_fsdp2_rank_memory": round(single["peak_rss_gib"] / rank_peak, 3),
                       "fsdp2_vs_single_tokens_per_s": round(results[1]["tokens_per_s"] / results[0]["tokens_per_s"], 3)},
            "targets": TARGETS}


def table(r: dict, command: str) -> str:
    single, fsdp = r["results"]
    rows = [("", "peak RSS GiB (per rank)", "tokens/s", "losses"),
            ("single", single["peak_rss_gib"], single["tokens_per_s"], " ".join(f"{x:.6f}" for x in single["losses"])),
            (fsdp["name"], " / ".join(str(x) for x in fsdp["rank_peak_rss_gib"]), fsdp["tokens_per_s"],
             " ".join(f"{x:.6f}" for x in fsdp["losses"]))]
    ratio, target = r["ratios"]["single_vs_fsdp2_rank_memory"], r["targets"]["single_vs_fsdp2_rank_memory"]
    m = r["model"]
    return "\n".join(common.align(rows)) + (
        f"\n\n{m['shape']} shape, {m['layers']} layers, {m['params'] / 1e6:.0f}M parameters ({m['fp32_state_gib']} GiB of "
        f"fp32 weights+grads+AdamW); loss max |diff| {r['loss_max_abs_diff']:.2e}\n"
        f"single_vs_fsdp2_rank_memory {ratio} (target >= {target}); fsdp2_vs_single_tokens_per_s "
        f"{r['ratios']['fsdp2_vs_single_tokens_per_s']}\nreproduce: {command}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--work", default=os.path.join(tempfile.gettempdir(), "areal-bench-models"))
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--strategy", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--sizes", help=argparse.SUPPRESS)
    args, _ = parser.parse_known_args()
    if args.worker:
        sys.path.insert(0, str(REPO))
        worker(args.worker, args.strategy, json.loads(args.sizes), args.out)
        return
    report = run(args)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2))
    print(table(report, "python benchmarks/speed/trainer.py --strategy fsdp --world 2" + (" --quick" if args.quick else "")))


if __name__ == "__main__":
    main()
