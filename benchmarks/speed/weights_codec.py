"""The delta encoder per GB: host numpy against torch on the tensors' device (`benchmarks/speed/weights.py --codec`).

What it measures, in one run: a bf16 shard of BYTES (a Qwen2.5-0.5B-sized 1 GB; --quick 64 MB) in tensors of
QKV/MLP shapes, changed by an Adam-like step of fixed size at three learning rates (a share of the elements
changes, as RL steps do: ~0.5 %, ~2 %, ~15 % at bf16), encoded by areal_mq/weights/delta.encode
- `numpy`: the host path every CPU rank takes (numpy over zero-copy views; both encodings tried, the smaller kept);
- `torch`: the device path a GPU rank takes (compare, positions and xor by torch on --device; the xor only for a
  dense change), forced on the CPU when --device is cpu.
Per run: seconds per GB of the shard (median of REPEATS), the frame bytes as a share of the full bytes, and the
encoding chosen. Every frame is applied and checked against the new shard's checksum (a wrong frame fails the
run). Ratios: numpy_vs_torch_encode_s (numpy's time over torch's at ~2 % changed: above 1, the device path is
faster) and torch_vs_numpy_bytes (torch's frame bytes over numpy's at ~2 %: its cost in size, >= 1).
Both paths try the full-size xor only for a dense change (delta.XOR_DENSITY). CPU ranks use numpy (one
thread: a publish runs beside the next training step and must not take its torch threads); on a GPU the
compare runs at device bandwidth, a figure that needs a GPU (docs/gpu.md).

    python benchmarks/speed/weights.py --codec [--quick] [--device cpu|cuda] [--json PATH]
"""
from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py (it adds the kinds' folders)
import common  # noqa: E402

REPEATS = 3
LRS = (3e-7, 1e-6, 1e-5)
SHAPES = [(896, 896), (4864, 896), (896, 4864)]  # Qwen2.5-0.5B's attention and MLP matrices
log = common.logger("weights-codec")


def shard(total_bytes: int, device: Any, seed: int = 0) -> dict:
    import torch

    g = torch.Generator().manual_seed(seed)
    out, size, i = {}, 0, 0
    while size < total_bytes:
        shape = SHAPES[i % len(SHAPES)]
        t = (torch.randn(shape, generator=g) * 0.02).to(torch.bfloat16)
        out[f"layers.{i // 3}.w{i % 3}"] = t.to(device)
        size += t.numel() * 2
        i += 1
    return out


def step(weights: dict, lr: float, seed: int) -> dict:
    import torch

    g = torch.Generator().manual_seed(seed)
    return {k: (t.float() - lr * torch.sign(torch.randn(t.shape, generator=g)).to(t.device)).to(t.dtype)
            for k, t in weights.items()}


def encode_all(base: dict, new: dict, on_device: bool) -> tuple[list, float]:
    import torch

    from areal_mq.weights.delta import encode

    if any(t.device.type == "cuda" for t in new.values()):
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    deltas = [encode(k, base[k], new[k], on_device=on_device) for k in new]
    return deltas, time.perf_counter() - t0


def run(args: Any) -> dict:
    import torch

    from areal_mq.devices import resolve_device
    from areal_mq.weights.delta import apply, checksum

    device = resolve_device(args.device)
    total = (64 if args.quick else 1024) << 20
    base = shard(total, device)
    nbytes = sum(t.numel() * 2 for t in base.values())
    host_base = {k: t.cpu() for k, t in base.items()}
    rows = []
    for i, lr in enumerate(LRS):
        new = step(base, lr, seed=i + 1)
        host_new = {k: t.cpu() for k, t in new.items()}
        changed = sum(int((base[k].view(torch.int16) != new[k].view(torch.int16)).sum()) for k in base) / (nbytes / 2)
        for path in ("numpy", "torch"):
            times, deltas = [], []
            for _ in range(REPEATS):
                if path == "numpy":
                    deltas, s = encode_all(host_base, host_new, on_device=False)
                else:
                    deltas, s = encode_all(base, new, on_device=True)
                times.append(s)
            for d in deltas:  # every frame lands exactly on the new shard
                if checksum(apply(host_base[d.name], d)) != checksum(host_new[d.name]):
                    raise SystemExit(f"{path} lr {lr}: {d.name} does not apply to the new shard")
            encodings = sorted({d.encoding for d in deltas})
            row = {"lr": lr, "changed": round(changed, 4), "path": path, "device": str(device),
                   "s_per_gb": round(statistics.median(times) / (nbytes / 1e9), 3),
                   "bytes_share": round(sum(d.nbytes for d in deltas) / nbytes, 4), "encodings": encodings}
            rows.append(row)
            log(f"lr {lr:g} changed {changed:.2%} {path:5s}: {row['s_per_gb']} s/GB, frames "
                f"{row['bytes_share']:.2%} of the bytes ({'/'.join(encodings)})")
    at = {r["path"]: r for r in rows if r["lr"] == 1e-6}
    ratios = {"numpy_vs_torch_encode_s": round(at["numpy"]["s_per_gb"] / at["torch"]["s_per_gb"], 3),
              "torch_vs_numpy_bytes": round(at["torch"]["bytes_share"] / at["numpy"]["bytes_share"], 3)}
    return {"benchmark": "weights_codec", "quick": args.quick,
            "machine": common.torch_machine(device=common.device_name(args.device), threads=torch.get_num_threads()),
            "shard_bytes": nbytes, "rows": rows, "ratios": ratios, "targets": {}}


def table(report: dict, command: str) -> str:
    rows = [("lr", "changed", "path", "s per GB", "frame bytes", "encodings")]
    for r in report["rows"]:
        rows.append((f"{r['lr']:g}", f"{r['changed']:.2%}", r["path"], r["s_per_gb"], f"{r['bytes_share']:.2%}",
                     "/".join(r["encodings"])))
    lines = [f"Delta encoder on {report['machine']['device']}, a {report['shard_bytes'] / 2**20:.0f} MiB bf16 shard",
             *common.align(rows), "", *common.align(common.ratio_rows(report)), "", command]
    return "\n".join(lines)


def main(args: Any) -> None:
    report = common.timed(run, args)
    report["command"] = common.command("weights.py")
    common.finish(report, args.json, table(report, report["command"]))
