"""Long answers: one packed micro-batch at growing lengths, attention through the L x L mask (trainer.attention
sdpa) against block by block (varlen, areal_mq/algorithms/attention.py), side by side (issue 61 items 2 and 5).

What: the Qwen2.5-0.5B shape (hidden 896, 14 heads, 2 KV heads, the 151,936 vocabulary), `--layers` decoder layers
(default 2: the attention's memory is one layer's under gradient checkpointing, and 24 layers of 16k tokens would
take an hour on 2 cores), random weights built here, fp32 on the CPU (`--dtype bfloat16` for bf16 autocast),
gradient checkpointing. One micro-batch per length L: a GRPO group of 4 answers of (L - 256) / 4 tokens after one
256-token prompt, shared packing, a warm-up train_step (AdamW's state made), then the measured one (recompute,
forward, backward, AdamW). Each (attention, L) runs in a fresh process; its peak is the measured step's resident
high-water mark (VmHWM, reset through /proc/self/clear_refs before the step) minus the resident set before it: the
step's transient memory, the attention's included. Reported per L: the step's peak extra memory and seconds per 1k tokens for both, and the
ratios `long_mask_vs_varlen_peak_L` (sdpa peak / varlen peak; larger = varlen saves more) and
`long_varlen_vs_mask_speed_L` (sdpa seconds / varlen seconds). A length whose dense run exceeds `--max-gib` of
the machine is skipped and said so (the sdpa path's scores are [14, L, L] fp32 on the CPU).

    python benchmarks/speed/trainer.py --long [--lengths 2048,4096,8192] [--layers 2] [--json PATH] [--quick]
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


def _child(attention: str, length: int, layers: int, dtype: str, model_dir: str) -> dict:
    """One train_step of one micro-batch of `length` tokens; peak RSS above the built trainer, seconds."""
    import numpy as np
    import torch

    from areal_mq.algorithms.config import TrainerConfig
    from areal_mq.algorithms.trainer import Trainer
    from areal_mq.messages import Sample, SeqSample

    torch.set_num_threads(int(os.environ.get("LONG_THREADS", "2")))
    cfg = TrainerConfig(device="cpu", attention=attention, packing="shared", gradient_checkpointing=True,
                        max_tokens_per_mb=length + 8, precision="fp32" if dtype == "float32" else "bf16", lr=1e-6)
    trainer = Trainer(cfg, model_dir)
    rng = np.random.default_rng(0)
    n = (length - PROMPT) // GROUP
    prompt = rng.integers(0, 150000, PROMPT, dtype=np.int32)
    seqs = [SeqSample(prompt_ids=prompt, output_ids=rng.integers(0, 150000, n, dtype=np.int32),
                      logprobs=np.full(n, -3.0, np.float32), versions=np.zeros(n, np.int32), reward=float(i % 2))
            for i in range(GROUP)]
    batch = [Sample(sample_id="s0", prompt_id="p0", seqs=seqs)]
    trainer.train_step(batch)  # warm-up: AdamW's state exists from here on, as in every step of a run but the first
    base = _rss_kib("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:  # the peak (VmHWM) restarts from the current resident set
        f.write("5")
    t0 = time.perf_counter()
    metrics = trainer.train_step(batch)
    seconds = time.perf_counter() - t0
    peak = _rss_kib("VmHWM")
    return {"attention": attention, "length": PROMPT + GROUP * n, "peak_extra_gib": round((peak - base) / 2**20, 3),
            "seconds": round(seconds, 2), "s_per_1k_tokens": round(seconds * 1000 / (PROMPT + GROUP * n), 3),
            "loss": metrics["loss"], "n_microbatches": metrics["n_microbatches"]}


def run(args, tmp: Path) -> dict:
    from areal_mq.engines.shapes import build_random_model

    lengths = [512, 1024] if args.quick else args.lengths
    layers = 1 if args.quick else args.layers
    model_dir = tmp / f"qwen2.5-0.5b-{layers}l"
    build_random_model(model_dir, "qwen2.5-0.5b", num_hidden_layers=layers)
    rows, skipped = [], []
    for length in lengths:
        dense_scores_gib = 14 * length * length * 4 / 2**30
        if dense_scores_gib > args.max_gib:
            skipped.append({"length": length, "why": f"the sdpa path's [14, L, L] fp32 scores alone are "
                                                     f"{dense_scores_gib:.1f} GiB > --max-gib {args.max_gib}"})
            log(f"L {length}: skipped ({skipped[-1]['why']})")
            continue
        for attention in ("sdpa", "varlen"):
            log(f"L {length}: {attention} ...")
            out = subprocess.run([sys.executable, __file__, "--child", attention, str(length), str(layers), args.dtype,
                                  str(model_dir)], capture_output=True, text=True, timeout=3600,
                                 env={**os.environ, "HF_HUB_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": ""})
            if out.returncode != 0:
                raise RuntimeError(f"L {length} {attention} failed:\n{out.stderr[-3000:]}")
            rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
            log(f"L {length}: {attention} {rows[-1]['peak_extra_gib']} GiB, {rows[-1]['seconds']} s")
    ratios = {}
    for length in sorted({r["length"] for r in rows}):
        by = {r["attention"]: r for r in rows if r["length"] == length}
        if len(by) == 2:
            ratios[f"long_mask_vs_varlen_peak_{length}"] = round(by["sdpa"]["peak_extra_gib"] /
                                                                 max(by["varlen"]["peak_extra_gib"], 1e-3), 3)
            ratios[f"long_varlen_vs_mask_speed_{length}"] = round(by["sdpa"]["seconds"] / by["varlen"]["seconds"], 3)
            assert abs(by["sdpa"]["loss"] - by["varlen"]["loss"]) < 1e-3 * max(1.0, abs(by["sdpa"]["loss"])), by
    return {"machine": common.torch_machine(), "layers": layers, "dtype": args.dtype, "rows": rows, "skipped": skipped,
            "ratios": ratios, "plot": plot(rows, args.plot) if rows and args.plot else None}


def plot(rows: list[dict], path: Path) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for attention, style in (("sdpa", "o-"), ("varlen", "s-")):
        mine = sorted((r for r in rows if r["attention"] == attention), key=lambda r: r["length"])
        xs = [r["length"] for r in mine]
        axes[0].plot(xs, [r["peak_extra_gib"] for r in mine], style, label=attention)
        axes[1].plot(xs, [r["s_per_1k_tokens"] for r in mine], style, label=attention)
    axes[0].set(xlabel="tokens in the micro-batch", ylabel="peak extra RSS (GiB)", title="memory of one step")
    axes[1].set(xlabel="tokens in the micro-batch", ylabel="seconds per 1k tokens", title="time of one step")
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    return str(path)


def table(report: dict, cmd: str) -> str:
    rows = [("L", "attention", "peak extra GiB", "s / 1k tokens", "loss")]
    rows += [(str(r["length"]), r["attention"], f"{r['peak_extra_gib']:.3f}", f"{r['s_per_1k_tokens']:.3f}",
              f"{r['loss']:.6f}") for r in report["rows"]]
    lines = [cmd, f"Qwen2.5-0.5B shape, {report['layers']} layer(s), {report['dtype']}, gradient checkpointing, one "
             "shared-packed micro-batch (a 256-token prompt and 4 answers)", *common.align(rows)]
    lines += [f"{k} = {v}" for k, v in report["ratios"].items()]
    lines += [f"L {s['length']}: skipped, {s['why']}" for s in report["skipped"]]
    if report.get("plot"):
        lines.append(f"plot {report['plot']}")
    return "\n".join(lines)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        _, _, attention, length, layers, dtype, model_dir = sys.argv
        print(json.dumps(_child(attention, int(length), int(layers), dtype, model_dir)))
        return
    parser = common.arg_parser(__doc__, quick_help="Lengths 512 and 1024, one layer (seconds).")
    parser.add_argument("--lengths", type=lambda s: [int(x) for x in s.split(",") if x], default=[2048, 4096, 8192])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--max-gib", type=float, default=8.0, help="Skip a length whose dense scores exceed this.")
    parser.add_argument("--plot", type=Path, default=None, help="PNG of memory and time against L.")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    report = common.timed(run, args, tmp_prefix="trainer-long-")
    common.finish(report, args.json, table(report, common.command("trainer.py --long")))


if __name__ == "__main__":
    main()
