"""Trainer benchmark, loading: every FSDP rank loading the whole model vs each rank reading only its shards.

What it measures, in one run, 2 ranks under torch.distributed.run over gloo (CPU, one torch thread per rank), per
model shape (Qwen2.5-0.5B and 1.5B, their public configs with seeded random weights written ONCE as a sharded
bf16 checkpoint, `model-0000x-of-0000y.safetensors` + index, in a cache directory; areal_mq/engines/shapes.py):
  - full: trainer.fsdp.load full, the old path: every rank loads the whole model in fp32 on the host, then shards;
  - slices: the model built on the meta device, sharded, each rank reading only its rows, memory-mapped (default);
  - broadcast: the same, rank 0 reading each tensor whole and broadcasting it.
Each launch builds the trainer (strategy fsdp, fp32 master weights) and takes one training step where the machine
has room for its gradients and AdamW state (16 bytes per parameter / world per rank: not 1.5B on a 24 GiB host,
whose time is then taken to the loaded model). Reported per rank: peak RSS when the trainer is built (the load
peak: ru_maxrss, imports included, the same for all three), the RSS before loading, the load time, the time from
the launch to the loaded model and to the first step's end. Headline ratio `full_vs_sharded_load_rank_peak`
= the largest rank's load peak under full / under slices on the 0.5B shape (target >= 1.8 at world 2); also the
same ratio for broadcast and 1.5B, and full_vs_sharded_first_step (time to the first step, full / slices).
The three ways run one after another, in the order full, slices, broadcast (each its own processes, so no peak
carries over); glibc's mmap threshold is fixed at 1 MiB in every process (as benchmarks/speed/trainer_fsdp.py:
peak RSS follows the live tensors, not the heap's history). The full path needs (4 + 4 / world) bytes per parameter
per rank (1.5B at world 2: ~2 x 9.3 GiB): it is skipped, and said so, unless the machine has that and 3 GiB more
available. The checkpoints are written by a child process, so the parent holds no model while the ranks run.

    python benchmarks/speed/trainer.py --load [--quick] [--json PATH] [--cache DIR]
    (or python benchmarks/speed/trainer_load.py ...)

--quick: the 0.5B shape cut to 4 layers (same widths, vocabulary and code path), under a minute on 2 cores.
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
TARGETS = {"full_vs_sharded_load_rank_peak": 1.8}
LOADS = ("full", "slices", "broadcast")
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": str(2**20)}
SHARD_MB = 400  # the checkpoint's shard files (Qwen2.5's own are ~4 GB; smaller ones show the index path too)
log = common.logger("trainer-load")


def rss_gib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**30


def batch() -> list:
    import numpy as np

    from areal_mq.messages import Sample, SeqSample

    rng = np.random.default_rng(7)
    out = []
    for g in range(2):
        prompt = rng.integers(100, 49000, 32, dtype=np.int32)
        seqs = [SeqSample(prompt_ids=prompt, output_ids=rng.integers(100, 49000, 32, dtype=np.int32),
                          logprobs=np.full(32, -11.0, np.float32), versions=np.zeros(32, np.int32),
                          reward=float(k % 2)) for k in range(2)]
        out.append(Sample(sample_id=f"b{g}", seqs=seqs))
    return out


def worker(model_dir: str, how: str, out: str, started: float, step: bool) -> None:
    """One rank: build the fsdp trainer with trainer.fsdp.load `how`, take one step (when `step`), report."""
    import torch

    from areal_mq.algorithms.config import TrainerConfig
    from areal_mq.algorithms.trainer import Trainer

    torch.set_num_threads(1)
    cfg = TrainerConfig(strategy="fsdp", lr=1e-6, max_tokens_per_mb=512, seed=1, checkpoint_every=0)
    cfg.fsdp.load = how
    before = rss_gib()
    t0 = time.time()
    trainer = Trainer(cfg, model_dir, device="cpu")
    load_s = time.time() - t0
    load_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB -> GiB
    loaded_s = time.time() - started
    loss = trainer.train_step(batch())["loss"] if step else None
    Path(out, f"{how}-rank{trainer.rank}.json").write_text(json.dumps(
        {"load_peak_rss_gib": round(load_peak, 3), "rss_before_load_gib": round(before, 3),
         "load_s": round(load_s, 2), "loaded_s": round(loaded_s, 2),
         "first_step_end_s": round(time.time() - started, 2) if step else None,
         "step_peak_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 3),
         "loss": loss, "world": trainer.world_size}))


def sharded_checkpoint(cache: Path, shape: str, layers: int | None) -> Path:
    """The shape's random weights as a bf16 sharded checkpoint (built once; reused while its marker matches)."""
    from transformers import AutoModelForCausalLM

    from areal_mq.engines.shapes import build_random_model

    over = {"num_hidden_layers": layers} if layers else {}
    name = f"{shape}-l{layers}" if layers else shape
    dst = cache / f"{name}-sharded"
    mark = dst / ".bench-load.json"
    want = {"shape": shape, "over": over, "shard_mb": SHARD_MB, "dtype": "bfloat16"}
    if mark.is_file() and json.loads(mark.read_text()) == want:
        return dst
    single = build_random_model(cache / f"{name}-single", shape, dtype="bfloat16", **over)
    lm = AutoModelForCausalLM.from_pretrained(str(single), dtype="auto")
    lm.save_pretrained(str(dst), safe_serialization=True, max_shard_size=f"{SHARD_MB}MB")
    del lm
    for f in single.iterdir():  # the tokenizer files go along; the single-file weights are not needed again
        if not f.name.endswith(".safetensors") and f.is_file() and not (dst / f.name).exists():
            (dst / f.name).write_bytes(f.read_bytes())
    for f in single.glob("*.safetensors"):
        f.unlink()
    (single / ".random-model.json").unlink(missing_ok=True)
    mark.write_text(json.dumps(want))
    return dst


def build_in_child(cache: Path, shape: str, layers: int | None) -> Path:
    """sharded_checkpoint in a child process: the memory it takes to build the weights is returned when it ends."""
    code = ("import sys, trainer_load; from pathlib import Path; "
            f"print(trainer_load.sharded_checkpoint(Path({str(cache)!r}), {shape!r}, {layers!r}))")
    env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{HERE}{os.pathsep}{HERE.parent}", HF_HUB_OFFLINE="1")
    proc = subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO, capture_output=True, text=True, timeout=3000)
    if proc.returncode != 0:
        raise SystemExit(f"building the {shape} checkpoint failed:\n{proc.stderr[-3000:]}")
    return Path(proc.stdout.strip().splitlines()[-1])


def available_gib() -> float:
    with open("/proc/meminfo") as f:
        return next(int(l.split()[1]) for l in f if l.startswith("MemAvailable")) / 2**20


def launch(model_dir: Path, how: str, world: int, out: str, step: bool) -> list[dict]:
    env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{HERE}{os.pathsep}{HERE.parent}", OMP_NUM_THREADS="1",
               CUDA_VISIBLE_DEVICES="", HF_HUB_OFFLINE="1", **MALLOC_ENV)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(world), "--master_addr",
           "127.0.0.1", "--master_port", str(common.free_ports(1)[0]), __file__, "--worker", str(model_dir),
           "--how", how, "--out", out, "--started", repr(time.time()), "--step", str(int(step))]
    proc = subprocess.run(cmd, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=3000)
    if proc.returncode != 0:
        raise SystemExit(f"{how} on {model_dir.name} failed:\n{proc.stdout[-3000:]}")
    return [json.loads(Path(out, f"{how}-rank{r}.json").read_text()) for r in range(world)]


def run(args: argparse.Namespace) -> dict:
    from areal_mq.engines.shapes import parameter_count

    shapes = [("qwen2.5-0.5b", 4)] if args.quick else [("qwen2.5-0.5b", None), ("qwen2.5-1.5b", None)]
    results, ratios = [], {}
    for shape, layers in shapes:
        over = {"num_hidden_layers": layers} if layers else {}
        params = parameter_count(shape, **over)
        model_dir = build_in_child(Path(args.cache), shape, layers)
        # one step allocates gradients and AdamW: 16 bytes per parameter / world on every rank (1.5B at world 2:
        # 2 x 11.5 GiB, more than this 24 GiB machine holds); without room, time to the loaded model only
        step = available_gib() >= args.world * (16 * params / args.world / 2**30 + 1.5) + 3.0
        row = {"shape": shape, "layers": layers, "params": params, "files": len(list(model_dir.glob("*.safetensors"))),
               "fp32_model_gib": round(4 * params / 2**30, 2), "step": step}
        for how in LOADS:
            need = args.world * ((4 + 4 / args.world) * params / 2**30 + 0.7) + 3.0 if how == "full" else 0.0
            if need and available_gib() < need:
                row[how] = {"skipped": f"needs ~{need:.1f} GiB, {available_gib():.1f} GiB available"}
                log(f"{shape} {how}: skipped ({row[how]['skipped']})")
                continue
            out = tempfile.mkdtemp(prefix="bench-load-")
            t0 = time.perf_counter()
            ranks = launch(model_dir, how, args.world, out, step)
            log(f"{shape} {how}: {time.perf_counter() - t0:.0f} s, rank peaks "
                f"{[r['load_peak_rss_gib'] for r in ranks]} GiB")
            row[how] = {"rank_load_peak_gib": [r["load_peak_rss_gib"] for r in ranks],
                        "rank_rss_before_gib": [r["rss_before_load_gib"] for r in ranks],
                        "rank_step_peak_gib": [r["step_peak_rss_gib"] for r in ranks],
                        "load_s": max(r["load_s"] for r in ranks), "loaded_s": max(r["loaded_s"] for r in ranks),
                        "first_step_s": max(r["first_step_end_s"] for r in ranks) if step else None,
                        "loss": ranks[0]["loss"]}
        results.append(row)
        tag = "" if shape == "qwen2.5-0.5b" else "_" + shape.split("-")[1].replace(".", "")
        peak = {h: max(row[h]["rank_load_peak_gib"]) for h in LOADS if "rank_load_peak_gib" in row[h]}
        until = "first_step_s" if step else "loaded_s"  # time to the first step's end, or to the loaded model
        if "full" in peak:
            ratios[f"full_vs_sharded_load_rank_peak{tag}"] = round(peak["full"] / peak["slices"], 3)
            ratios[f"full_vs_broadcast_load_rank_peak{tag}"] = round(peak["full"] / peak["broadcast"], 3)
            ratios[f"full_vs_sharded_{until}{tag}"] = round(row["full"][until] / row["slices"][until], 3)
        ratios[f"broadcast_vs_sharded_{until}{tag}"] = round(row["broadcast"][until] / row["slices"][until], 3)
    return {"benchmark": "trainer_load", "quick": args.quick, "machine": common.torch_machine(device="cpu"),
            "env": MALLOC_ENV, "world": args.world, "results": results, "ratios": ratios, "targets": TARGETS}


def table(r: dict, command: str) -> str:
    rows = [("shape", "load", "rank load peak GiB", "RSS before GiB", "load s", "loaded at s", "first step s",
             "loss")]
    for row in r["results"]:
        for how in LOADS:
            x = row[how]
            if "skipped" in x:
                rows.append((row["shape"], how, "skipped: " + x["skipped"], "", "", "", "", ""))
                continue
            rows.append((row["shape"], how, " / ".join(str(v) for v in x["rank_load_peak_gib"]),
                         " / ".join(str(v) for v in x["rank_rss_before_gib"]), x["load_s"], x["loaded_s"],
                         x["first_step_s"] if x["first_step_s"] is not None else "no room for a step",
                         f"{x['loss']:.6f}" if x["loss"] is not None else ""))
    ratio = r["ratios"].get("full_vs_sharded_load_rank_peak")
    others = ", ".join(f"{k} {v}" for k, v in r["ratios"].items() if k != "full_vs_sharded_load_rank_peak")
    return "\n".join(common.align(rows)) + (
        f"\n\nworld {r['world']}; full_vs_sharded_load_rank_peak {ratio} (target >= "
        f"{r['targets']['full_vs_sharded_load_rank_peak']}); {others}\nreproduce: {command}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--cache", default=os.path.join(os.environ.get("AREAL_MQ_CACHE") or
                                                        os.path.expanduser("~/.cache/areal-mq"), "bench-load"))
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--how", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--started", type=float, help=argparse.SUPPRESS)
    parser.add_argument("--step", type=int, default=1, help=argparse.SUPPRESS)
    args, _ = parser.parse_known_args()
    if args.worker:
        sys.path.insert(0, str(REPO))
        worker(args.worker, args.how, args.out, args.started, bool(args.step))
        return
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    report = run(args)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2))
    print(table(report, "python benchmarks/speed/trainer.py --load" + (" --quick" if args.quick else "")))


if __name__ == "__main__":
    main()
