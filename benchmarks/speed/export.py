"""Export benchmark: `areal-mq checkpoint export` streamed tensor by tensor vs the whole-model export it replaced.

What it measures, in one run: the peak resident memory (VmHWM) and the wall time of exporting one checkpoint of
the Qwen2.5-0.5B shape (seeded random weights, areal_mq/engines/shapes.py; --quick: its first 2 layers) as
  - whole: the former export (until issue 52): the whole model built in fp32 in one process, the fsdp checkpoint's
    `sharded/` torch.distributed.checkpoint directory loaded into it, save_pretrained (fp32, one file), and
  - streamed: areal_mq.algorithms.export.export_model, bf16 shards of --max-shard-size with an index, from the same
    fsdp-layout checkpoint (`dcp`) and from the ddp layout (`safetensors`, the model.safetensors save_pretrained
    wrote),
each in its own process, alternating (--quick: once each). The checkpoint is written once: the random model
directory is the ddp layout; its state dict saved by torch.distributed.checkpoint in one process under
`model.lm.<name>` is the fsdp layout (one chunk per tensor where a 2-rank trainer writes two; the same reader).
Every export is checked against the model: each streamed bf16 tensor equals the whole export's fp32 tensor cast.
`whole_vs_streamed_export_peak` is the whole peak over the streamed (dcp) peak; the peak above the imports is
reported too, beside the arithmetic (one tensor in fp32 plus its bf16 cast: the embedding, 151936 x 896).

    python benchmarks/speed/export.py [--quick] [--json PATH] [--shape qwen2.5-0.5b] [--max-shard-size 500MB]
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py (it adds the kinds' folders)
import common  # noqa: E402

VARIANTS = ("whole", "streamed-dcp", "streamed-safetensors")
SIZES = {"layers": (2, None), "rounds": (1, 2)}  # quick, full (None: the shape's own)
MB = 1e6

log = common.logger("export")


def _status(field: str) -> int:
    """A /proc/self/status field in bytes (VmRSS, VmHWM)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))


def run_variant(variant: str, ckpt: Path, out: Path, shard: str) -> dict:
    """One export in this process: the peak resident memory, the resident memory after the imports, the time."""
    import time

    import torch
    import torch.distributed.checkpoint  # noqa: F401  (every variant pays the same imports before the baseline)
    import transformers  # noqa: F401

    from areal_mq.algorithms import export  # noqa: F401

    torch.set_num_threads(1)
    with open("/proc/self/clear_refs", "w") as f:  # reset VmHWM to the RSS now: the peak is this export's
        f.write("5")
    base = _status("VmRSS")
    t0 = time.perf_counter()
    if variant == "whole":
        whole_model_export(ckpt, out)
    else:
        from areal_mq.algorithms.export import export_model

        src = ckpt if variant == "streamed-dcp" else ckpt.parent / "model"
        export_model(src, out, dtype="bfloat16", max_shard_size=shard)
    return {"variant": variant, "seconds": round(time.perf_counter() - t0, 2), "peak_bytes": _status("VmHWM"),
            "imports_bytes": base}


def whole_model_export(ckpt: Path, out: Path) -> None:
    """The export before issue 52 (algorithms/fsdp.export_hf): the whole fp32 model, loaded, saved in one file."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from transformers import AutoConfig, AutoModelForCausalLM

    lm = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(ckpt)), dtype=torch.float32)
    state = {"model": {f"lm.{k}": v for k, v in lm.state_dict().items()}}
    dcp.load(state, checkpoint_id=str(ckpt / "sharded"), planner=DefaultLoadPlanner(allow_partial_load=True),
             no_dist=True)
    lm.load_state_dict({k[3:]: v for k, v in state["model"].items()})
    out.mkdir(parents=True, exist_ok=True)
    lm.save_pretrained(str(out), safe_serialization=True)


def build_checkpoint(tmp: Path, shape: str, layers: int | None) -> Path:
    """The ddp layout (tmp/model, the random model directory) and the fsdp layout (tmp/step00000001/sharded)."""
    import torch
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file

    from areal_mq.engines.shapes import build_random_model

    torch.set_num_threads(2)
    overrides = {} if layers is None else {"num_hidden_layers": layers}
    model = build_random_model(tmp / "model", shape, seed=0, **overrides)
    ckpt = tmp / "step00000001"
    ckpt.mkdir()
    for f in model.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy2(f, ckpt / f.name)
    (ckpt / "trainer_state.json").write_text(json.dumps({"version": 1, "strategy": "fsdp", "format": "dcp"}))
    state = load_file(str(model / "model.safetensors"))
    dcp.save({"model": {f"lm.{k}": v for k, v in state.items()}}, checkpoint_id=str(ckpt / "sharded"), no_dist=True)
    return ckpt


def check_same(out: Path) -> int:
    """Every bf16 tensor of each streamed export equals the whole export's fp32 tensor cast; returns the count."""
    import torch
    from safetensors import safe_open

    whole = out / "whole"
    ref = {}
    for f in whole.glob("*.safetensors"):
        with safe_open(str(f), "pt") as h:
            ref.update({k: f for k in h.keys()})
    count = 0
    for variant in VARIANTS[1:]:
        for f in (out / variant).glob("*.safetensors"):
            with safe_open(str(f), "pt") as h:
                for k in h.keys():
                    with safe_open(str(ref[k]), "pt") as r:
                        assert torch.equal(h.get_tensor(k), r.get_tensor(k).to(torch.bfloat16)), (variant, k)
                    count += 1
    return count


def main() -> None:
    parser = common.arg_parser(__doc__)
    parser.add_argument("--shape", default="qwen2.5-0.5b", help="A shape of areal_mq/engines/shapes.py.")
    parser.add_argument("--max-shard-size", default="500MB", help="The streamed export's shard size.")
    parser.add_argument("--variant", help=argparse.SUPPRESS)
    parser.add_argument("--dir", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.variant:  # a child: one export, its numbers on stdout
        print(json.dumps(run_variant(args.variant, args.dir / "step00000001", args.dir / "out" / args.variant,
                                     args.max_shard_size)))
        return
    report = common.timed(run, args, tmp_prefix="export-bench-")
    rows = [("variant", "peak MB", "above imports MB", "seconds")]
    for v in VARIANTS:
        rows.append((v, f"{report['peak_mb'][v]:.0f}", f"{report['above_imports_mb'][v]:.0f}",
                     f"{report['seconds'][v]:.1f}"))
    table = "\n".join(common.align(rows) + [""] + common.align(common.ratio_rows(report))
                      + [f"arithmetic (streamed): largest tensor {report['largest_tensor_mb']:.0f} MB fp32 + "
                         f"{report['largest_tensor_mb'] / 2:.0f} MB bf16; model {report['model_mb']:.0f} MB fp32",
                         common.command("speed/export.py")])
    common.finish(report, args.json, table)


def run(args, tmp: Path) -> dict:
    from areal_mq.engines.shapes import shape

    quick = 0 if args.quick else 1
    layers, rounds = SIZES["layers"][quick], SIZES["rounds"][quick]
    log(f"building the {args.shape} checkpoint (layers: {layers or 'all'}) in {tmp}")
    build_checkpoint(tmp, args.shape, layers)
    results = []
    for r in range(rounds):
        for v in VARIANTS if r % 2 == 0 else reversed(VARIANTS):
            shutil.rmtree(tmp / "out" / v, ignore_errors=True)
            cmd = [sys.executable, __file__, "--variant", v, "--dir", str(tmp), "--max-shard-size", args.max_shard_size]
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
            if done.returncode:
                raise SystemExit(f"{v} failed:\n{done.stderr[-3000:]}")
            results.append(json.loads(done.stdout.strip().splitlines()[-1]))
            log(f"round {r}: {results[-1]}")
    checked = check_same(tmp / "out")
    med = {v: {k: statistics.median(x[k] for x in results if x["variant"] == v)
               for k in ("peak_bytes", "imports_bytes", "seconds")} for v in VARIANTS}
    fields = shape(args.shape)
    largest = max(fields["vocab_size"] * fields["hidden_size"], fields["intermediate_size"] * fields["hidden_size"])
    files = sorted(p.name for p in (tmp / "out" / "streamed-dcp").iterdir())
    return {
        "benchmark": "export", "quick": args.quick,
        "machine": common.torch_machine(shape=args.shape, layers=layers or fields["num_hidden_layers"],
                                        max_shard_size=args.max_shard_size),
        "results": results, "streamed_files": files, "tensors_checked": checked,
        "peak_mb": {v: m["peak_bytes"] / MB for v, m in med.items()},
        "above_imports_mb": {v: (m["peak_bytes"] - m["imports_bytes"]) / MB for v, m in med.items()},
        "seconds": {v: m["seconds"] for v, m in med.items()},
        "largest_tensor_mb": largest * 4 / MB,
        "model_mb": (tmp / "model" / "model.safetensors").stat().st_size / MB,
        "ratios": {"whole_vs_streamed_export_peak": med["whole"]["peak_bytes"] / med["streamed-dcp"]["peak_bytes"]},
        "targets": {},
    }


if __name__ == "__main__":
    main()
