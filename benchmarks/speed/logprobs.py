"""Logprobs benchmark: full-vocabulary logits vs chunked_logprobs (areal_mq/algorithms/logprobs.py), side by side.

What it measures, in one run: the peak memory and the time of one forward + backward of the chosen tokens'
logprobs (with entropies, as the training loss asks) from hidden states [tokens, 896] through an LM head
[151,936, 896] (Qwen2.5-0.5B's head; fp32, or a bf16 autocast over fp32 weights with --bf16), computed
  - full: the whole [tokens, vocabulary] fp32 logits, log-softmax and gather (the trainer's former path), and
  - chunked: chunked_logprobs with chunks from chunk_tokens_for(vocabulary, --chunk-mb).
Each variant runs in its own process, the two alternating (--quick: once each); a process builds its inputs,
resets its peak RSS (/proc/self/clear_refs), runs, and reports VmHWM minus the RSS before the run (on CUDA:
one warm-up call first, then the median of 3 timed calls, and max_memory_allocated minus memory_allocated).
Both peaks include the head's fp32 weight gradient (tokens-independent, 0.5 GiB). `full_vs_chunked_peak_memory`
is the median full peak over the median chunked peak (target >= 4); `chunked_vs_full_speed` the median full time
over the median chunked time (reported: the chunked backward recomputes the logits, a fourth matmul to three).
The full variant at 8,192 tokens needs about 20 GB of memory; --quick (2,048 tokens) about 5 GB.

    python benchmarks/speed/logprobs.py [--quick] [--json PATH] [--tokens N] [--chunk-mb MiB] [--threads N] [--bf16]
                                  [--device cpu|cuda|cuda:N]
"""
from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from functools import partial

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py (it adds the kinds' folders)
import common  # noqa: E402

VOCAB, HIDDEN = 151_936, 896  # Qwen2.5-0.5B
TARGETS = {"full_vs_chunked_peak_memory": 4.0}
SIZES = {"tokens": (2048, 8192), "rounds": (1, 2)}  # quick, full
VARIANTS = ("full", "chunked")
GIB = 2**30

log = common.logger("logprobs")


def measure(variant: str, tokens: int, chunk_mb: float, device_spec: str, threads: int, bf16: bool) -> dict:
    """One forward + backward of `variant` in this process: its peak memory above the inputs, and its time."""
    import torch

    from areal_mq.algorithms.logprobs import chunk_tokens_for, chunked_logprobs, full_logprobs
    from areal_mq.devices import resolve_device

    torch.set_num_threads(threads)
    device = resolve_device(device_spec)
    gen = torch.Generator(device=device).manual_seed(0)
    hidden = torch.randn(tokens, HIDDEN, device=device, generator=gen).requires_grad_()
    weight = torch.randn(VOCAB, HIDDEN, device=device, generator=gen).mul_(0.02).requires_grad_()
    targets = torch.randint(0, VOCAB, (tokens,), device=device, generator=gen)
    upstream = torch.randn(tokens, device=device, generator=gen)
    chunk = chunk_tokens_for(VOCAB, chunk_mb)
    fn = full_logprobs if variant == "full" else partial(chunked_logprobs, chunk_tokens=chunk)
    warmup, repeats = (1, 3) if device.type == "cuda" else (0, 1)  # CUDA's first call loads kernels, handles
    seconds = []
    for i in range(warmup + repeats):
        hidden.grad = weight.grad = None
        if i == warmup:
            before = peak_reset(device)
        started = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            logp, entropy = fn(hidden, weight, targets, 1.0, with_entropy=True)
        (logp * upstream).sum().backward()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seconds.append(time.perf_counter() - started)
        del logp
    return {"name": variant, "tokens": tokens, "chunk_tokens": min(chunk, tokens) if variant == "chunked" else tokens,
            "peak_bytes": peak_since(device, before), "seconds": statistics.median(seconds[warmup:]),
            "entropy_mean": float(entropy.mean())}


def peak_reset(device) -> int:
    """Reset the peak-memory counter; the memory in use now (bytes), which the peak is measured above."""
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        return torch.cuda.memory_allocated(device)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM (peak RSS) to the current RSS
    return status_kib("VmRSS") * 1024


def peak_since(device, before: int) -> int:
    import torch

    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) - before
    peak = max(status_kib("VmHWM"), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)  # both KiB
    return peak * 1024 - before


def status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def run(args: argparse.Namespace) -> dict:
    tokens = args.tokens or SIZES["tokens"][0 if args.quick else 1]
    rounds = SIZES["rounds"][0 if args.quick else 1]
    samples = {v: [] for v in VARIANTS}
    for r in range(rounds):
        for variant in VARIANTS if r % 2 == 0 else VARIANTS[::-1]:  # alternate which goes first
            argv = [sys.executable, __file__, "--child", variant, "--tokens", str(tokens), "--chunk-mb",
                    str(args.chunk_mb), "--threads", str(args.threads), "--device", args.device]
            argv += ["--bf16"] if args.bf16 else []
            out = subprocess.run(argv, check=True, stdout=subprocess.PIPE, text=True).stdout
            samples[variant].append(json.loads(out.strip().splitlines()[-1]))
            s = samples[variant][-1]
            log(f"round {r + 1}/{rounds} {variant}: peak {s['peak_bytes'] / GIB:.2f} GiB, {s['seconds']:.1f} s")
    results = [{**ss[0], "peak_bytes": statistics.median(s["peak_bytes"] for s in ss),
                "seconds": statistics.median(s["seconds"] for s in ss), "runs": len(ss)}
               for ss in samples.values()]
    by = {r["name"]: r for r in results}
    ratios = {"full_vs_chunked_peak_memory": by["full"]["peak_bytes"] / by["chunked"]["peak_bytes"],
              "chunked_vs_full_speed": by["full"]["seconds"] / by["chunked"]["seconds"]}
    machine = common.torch_machine(device=common.device_name(args.device), threads=args.threads)
    setup = {"name": "setup", "vocab": VOCAB, "hidden": HIDDEN, "tokens": tokens, "chunk_mb": args.chunk_mb,
             "precision": "bf16 autocast" if args.bf16 else "fp32", "with_entropy": True}
    return {"benchmark": "logprobs", "quick": args.quick, "machine": machine, "results": [setup, *results],
            "ratios": ratios, "targets": dict(TARGETS)}


def table(report: dict, command: str) -> str:
    setup, *variants = report["results"]
    rows = [("variant", "tokens/chunk", "peak GiB", "fwd+bwd s")]
    rows += [(v["name"], str(v["chunk_tokens"]), f"{v['peak_bytes'] / GIB:.2f}", f"{v['seconds']:.2f}")
             for v in variants]
    note = (f"vocab {setup['vocab']}, hidden {setup['hidden']}, {setup['tokens']} tokens, {setup['precision']}, "
            f"with entropy; {report['machine']['device']}, {report['machine']['threads']} threads; "
            f"load avg {report['machine']['loadavg_at_start'][0]:.1f}")
    return "\n".join([*common.align(rows), "", *common.align(common.ratio_rows(report)), note,
                      f"command: {command}"])


def main() -> None:
    parser = common.arg_parser(__doc__, quick_help="2,048 tokens, one run each (same code path).")
    parser.add_argument("--tokens", type=int, default=0, help="Tokens (default 8192; --quick 2048).")
    parser.add_argument("--chunk-mb", type=float, default=256.0, help="chunk_tokens_for budget, MiB of fp32 logits.")
    parser.add_argument("--threads", type=int, default=2, help="torch threads in each measuring process.")
    parser.add_argument("--bf16", action="store_true", help="Under a bf16 autocast over fp32 weights (as on GPU).")
    parser.add_argument("--child", choices=VARIANTS, help=argparse.SUPPRESS)  # internal: measure one variant
    common.add_device_arg(parser)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.child, args.tokens, args.chunk_mb, args.device, args.threads, args.bf16)))
        return
    report = common.timed(run, args)
    common.finish(report, args.json, table(report, common.command("logprobs.py")))


if __name__ == "__main__":
    main()
