"""Long answers: one packed micro-batch at growing lengths, attention through the L x L mask (trainer.attention
sdpa, the dense mask) against block by block (varlen, areal_mq/algorithms/attention.py), side by side (issue 61
items 2 and 5).

What: the Qwen2.5-0.5B shape (hidden 896, 14 heads, 2 KV heads, the 151,936 vocabulary; `--shape` another of
areal_mq/engines/shapes.py), `--layers` decoder layers (default 2: under gradient checkpointing the attention's
memory is one layer's, and 24 layers of 16k tokens would take an hour on 2 cores), random weights built here, fp32
on the CPU (`--dtype bfloat16` for bf16 autocast), gradient checkpointing. One micro-batch per length L: a GRPO group
of 4 answers of (L - 256) / 4 tokens after one 256-token prompt, shared packing. A warm-up train_step on a short
batch (AdamW's state made, as in every step of a run but the first), then the measured one at L (proximal
recompute, forward, backward, AdamW). Each (attention, L) runs in a fresh process.
Memory, two figures per run, both above the resident set before the measured step (VmHWM reset through
/proc/self/clear_refs; on a GPU torch.cuda's peak allocated above the allocated before):
  - `mb_peak_gib`: the peak up to the optimizer's step: the micro-batch's recompute, forward and backward, the
    issue's "peak memory of one micro-batch"; the ratios below use it,
  - `step_peak_gib`: the whole step's, AdamW's update included (a constant in L: the parameters' size).
Reported per L: both peaks and seconds per 1k tokens for both attentions, `dense_vs_block_mask_peak_L` (sdpa's
micro-batch peak / varlen's; larger = the block mask saves more), `block_vs_dense_speed_L` (sdpa seconds / varlen
seconds), and over the lengths `<attention>_peak_growth_<a>_to_<b>` (peak at the longest / at 8k or the shortest).
What the dense mask costs where, measured (RESULTS.md): torch's CPU SDPA takes the boolean mask into its flash
kernel and copies it to fp32, never making the [heads, L, L] scores, so the mask costs 5 bytes per pair (1.25 GiB at
16k, 5 GiB at 32k); a length whose mask exceeds `--max-gib` is skipped and said so.

    python benchmarks/speed/trainer.py --long [--lengths 2048,8192,16384,32768] [--layers 2] [--device cuda]
        [--shape qwen2.5-7b] [--json PATH] [--plot PNG] [--quick]
--quick: lengths 512 and 1024, one layer (the code path, seconds).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
import common  # noqa: E402

log = common.logger("trainer-long")
PROMPT = 256
GROUP = 4


def _rss_kib(field: str) -> int:
    """/proc/self/status's VmRSS (resident now) or VmHWM (peak since the last clear_refs 5), KiB."""
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def _batch(length: int):
    """One GRPO group: a PROMPT-token prompt and GROUP answers filling `length` tokens (shared packing: one row)."""
    import numpy as np

    from areal_mq.messages import Sample, SeqSample

    rng = np.random.default_rng(length)
    n = (length - PROMPT) // GROUP
    prompt = rng.integers(0, 150000, PROMPT, dtype=np.int32)
    seqs = [SeqSample(prompt_ids=prompt, output_ids=rng.integers(0, 150000, n, dtype=np.int32),
                      logprobs=np.full(n, -3.0, np.float32), versions=np.zeros(n, np.int32), reward=float(i % 2))
            for i in range(GROUP)]
    return [Sample(sample_id="s0", prompt_id="p0", seqs=seqs)], PROMPT + GROUP * n


class _Peak:
    """Memory above a base: the process's resident high-water mark on the CPU, torch's peak allocated on a GPU."""

    def __init__(self, device: str):
        import torch

        self.cuda = device.startswith("cuda")
        self.torch = torch

    def now(self) -> float:
        if self.cuda:
            return self.torch.cuda.memory_allocated() / 2**30
        return _rss_kib("VmRSS") / 2**20

    def reset(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize()
            self.torch.cuda.reset_peak_memory_stats()
        else:
            with open("/proc/self/clear_refs", "w") as f:  # the peak (VmHWM) restarts from the current resident set
                f.write("5")

    def peak(self) -> float:
        if self.cuda:
            self.torch.cuda.synchronize()
            return self.torch.cuda.max_memory_allocated() / 2**30
        return _rss_kib("VmHWM") / 2**20


def _child(attention: str, length: int, layers: int, dtype: str, model_dir: str, device: str) -> dict:
    """One train_step of one micro-batch of `length` tokens: its peaks above the built trainer, seconds."""
    import torch

    from areal_mq.algorithms.config import TrainerConfig
    from areal_mq.algorithms.trainer import Trainer

    torch.set_num_threads(int(os.environ.get("LONG_THREADS", "2")))
    cfg = TrainerConfig(device=device, attention=attention, packing="shared", gradient_checkpointing=True,
                        max_tokens_per_mb=length + 8, precision="fp32" if dtype == "float32" else "bf16", lr=1e-6)
    trainer = Trainer(cfg, model_dir)
    trainer.train_step(_batch(PROMPT + GROUP * 16)[0])  # warm-up: AdamW's state, the allocator, the kernels
    batch, tokens = _batch(length)
    mem = _Peak(device)
    seen: dict[str, float] = {}
    step = trainer.optimizer.step

    def step_seen(*a, **kw):  # the micro-batch's peak is the one before AdamW's update starts
        seen.setdefault("mb", mem.peak())
        return step(*a, **kw)

    trainer.optimizer.step = step_seen
    base = mem.now()
    mem.reset()
    t0 = time.perf_counter()
    metrics = trainer.train_step(batch)
    seconds = time.perf_counter() - t0
    peak = mem.peak()
    return {"attention": attention, "length": tokens, "mb_peak_gib": round(seen["mb"] - base, 3),
            "step_peak_gib": round(peak - base, 3), "seconds": round(seconds, 2),
            "s_per_1k_tokens": round(seconds * 1000 / tokens, 3), "loss": metrics["loss"],
            "n_microbatches": metrics["n_microbatches"]}


def mask_gib(length: int) -> float:
    """The dense path's mask on the CPU: the [L, L] bool and SDPA's fp32 copy of it, 5 bytes a pair (RESULTS.md)."""
    return 5 * length * length / 2**30


def run(args, tmp: Path) -> dict:
    from tqdm import tqdm

    from areal_mq.engines.shapes import build_random_model

    lengths = [512, 1024] if args.quick else args.lengths
    layers = 1 if args.quick else args.layers
    model_dir = tmp / f"{args.shape}-{layers}l"
    build_random_model(model_dir, args.shape, num_hidden_layers=layers)
    rows, skipped = [], []
    for length, attention in tqdm([(n, a) for n in lengths for a in ("sdpa", "varlen")], desc="micro-batches",
                                  unit="run", file=sys.stderr):
        if attention == "sdpa" and mask_gib(length) > args.max_gib:
            skipped.append({"length": length, "attention": attention,
                            "why": f"the dense mask alone is {mask_gib(length):.1f} GiB > --max-gib {args.max_gib}"})
            log(f"L {length}: sdpa skipped ({skipped[-1]['why']})")
            continue
        log(f"L {length}: {attention} ...")
        out = subprocess.run([sys.executable, __file__, "--child", attention, str(length), str(layers), args.dtype,
                              str(model_dir), args.device], capture_output=True, text=True, timeout=7200,
                             env={**os.environ, "HF_HUB_OFFLINE": "1",
                                  **({"CUDA_VISIBLE_DEVICES": ""} if args.device == "cpu" else {})})
        if out.returncode != 0:
            raise RuntimeError(f"L {length} {attention} failed:\n{out.stderr[-3000:]}")
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
        log(f"L {length}: {attention} micro-batch {rows[-1]['mb_peak_gib']} GiB, step "
            f"{rows[-1]['step_peak_gib']} GiB, {rows[-1]['seconds']} s")
    return {"machine": common.torch_machine(), "shape": args.shape, "layers": layers, "dtype": args.dtype,
            "device": args.device, "rows": rows, "skipped": skipped, "ratios": ratios(rows),
            "plot": plot(rows, args.plot) if rows and args.plot else None}


def ratios(rows: list[dict]) -> dict:
    """dense_vs_block_mask_peak_L and block_vs_dense_speed_L where both ran at L; each attention's peak growth."""
    out = {}
    for length in sorted({r["length"] for r in rows}):
        by = {r["attention"]: r for r in rows if r["length"] == length}
        if len(by) == 2:
            k = _k(length)
            out[f"dense_vs_block_mask_peak_{k}"] = round(by["sdpa"]["mb_peak_gib"] / max(by["varlen"]["mb_peak_gib"],
                                                                                         1e-3), 3)
            out[f"block_vs_dense_speed_{k}"] = round(by["sdpa"]["seconds"] / by["varlen"]["seconds"], 3)
            if abs(by["sdpa"]["loss"] - by["varlen"]["loss"]) > 1e-3 * max(1.0, abs(by["sdpa"]["loss"])):
                raise RuntimeError(f"L {length}: the two attentions' losses differ: {by}")
    for attention in ("sdpa", "varlen"):
        mine = sorted((r for r in rows if r["attention"] == attention), key=lambda r: r["length"])
        if len(mine) >= 2:
            lo = next((r for r in mine if r["length"] >= 8000), mine[0])
            hi = mine[-1]
            if hi is not lo:
                out[f"{attention}_peak_growth_{_k(lo['length'])}_to_{_k(hi['length'])}"] = round(
                    hi["mb_peak_gib"] / max(lo["mb_peak_gib"], 1e-3), 3)
    return out


def _k(length: int) -> str:
    """16384 -> '16k' (the issue's names), a length under 1k or off the 1k grid as itself."""
    return f"{round(length / 1024)}k" if length >= 1000 and abs(length / 1024 - round(length / 1024)) < 0.02 else str(length)


def plot(rows: list[dict], path: Path) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for attention, style in (("sdpa", "o-"), ("varlen", "s-")):
        mine = sorted((r for r in rows if r["attention"] == attention), key=lambda r: r["length"])
        xs = [r["length"] for r in mine]
        axes[0].plot(xs, [r["mb_peak_gib"] for r in mine], style, label=attention)
        axes[1].plot(xs, [r["s_per_1k_tokens"] for r in mine], style, label=attention)
    axes[0].set(xlabel="tokens in the micro-batch", ylabel="peak above the trainer (GiB)", title="memory of one micro-batch")
    axes[1].set(xlabel="tokens in the micro-batch", ylabel="seconds per 1k tokens", title="time of one step")
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    return str(path)


def table(report: dict, cmd: str) -> str:
    rows = [("L", "attention", "micro-batch peak GiB", "step peak GiB", "s / 1k tokens", "loss")]
    rows += [(str(r["length"]), r["attention"], f"{r['mb_peak_gib']:.3f}", f"{r['step_peak_gib']:.3f}",
              f"{r['s_per_1k_tokens']:.3f}", f"{r['loss']:.6f}") for r in report["rows"]]
    lines = [cmd, f"{report['shape']} shape, {report['layers']} layer(s), {report['dtype']}, {report['device']}, "
             "gradient checkpointing, one shared-packed micro-batch (a 256-token prompt and 4 answers)",
             *common.align(rows)]
    lines += [f"{k} = {v}" for k, v in report["ratios"].items()]
    lines += [f"L {s['length']} {s['attention']}: skipped, {s['why']}" for s in report["skipped"]]
    if report.get("plot"):
        lines.append(f"plot {report['plot']}")
    return "\n".join(lines)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        _, _, attention, length, layers, dtype, model_dir, device = sys.argv
        print(json.dumps(_child(attention, int(length), int(layers), dtype, model_dir, device)))
        return
    parser = common.arg_parser(__doc__, quick_help="Lengths 512 and 1024, one layer (seconds).")
    parser.add_argument("--lengths", type=lambda s: [int(x) for x in s.split(",") if x], default=[2048, 8192, 16384, 32768])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--max-gib", type=float, default=8.0, help="Skip the dense path where its mask exceeds this.")
    parser.add_argument("--device", default="cpu", help="cpu, or cuda for the GPU stage (benchmarks/gpu/).")
    parser.add_argument("--shape", default="qwen2.5-0.5b", help="A shape of areal_mq/engines/shapes.py.")
    parser.add_argument("--plot", type=Path, default=None, help="PNG of memory and time against L.")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    report = common.timed(run, args, tmp_prefix="trainer-long-")
    command = " ".join(["python benchmarks/speed/trainer.py --long", *sys.argv[1:]])  # trainer.py drops the flag
    common.finish(report, args.json, table(report, command))


if __name__ == "__main__":
    main()
