"""Stage l: the FSDP2 trainer (world 1) builds Qwen2.5-7B and 14B shapes on the meta device, loads them from a
sharded bf16 checkpoint, and takes one training step where memory allows; load peaks on device and host recorded.

What it does, per shape (areal_mq/engines/shapes.py; --quick: tiny Qwen2, same code path):
  1. writes the shape's seeded random weights as `model-0000x-of-0000y.safetensors` + index (bf16, drawn on the
     device, 4 GB shards), then frees them;
  2. asks `areal-mq plan`'s arithmetic (areal_mq/launch/plan.py) for this layout on this device and this host:
     train on the device when the plan fits it, else with trainer.fsdp.offload when the host holds 16 bytes per
     parameter, else load only (14B at world 1 needs 235 GB for fp32 weights + gradients + AdamW: neither an H200
     nor its 128 GB host; the step is then skipped, and the plan's figures say why);
  3. builds the trainer (strategy fsdp, world 1, bf16 MixedPrecisionPolicy, trainer.fsdp.load slices, activation
     checkpointing), recording the load time, the device's peak (torch.cuda.max_memory_allocated) and the host's
     (ru_maxrss) while it builds, against the plan's load estimate;
  4. one training step (1 group x 2 sequences of 128 + 128 tokens), its time and peaks.
Each shape's checkpoint is deleted after its run (the lent machine has 64 GB of disk: 7B is 15 GB, 14B 30 GB).

    python benchmarks/gpu/stage_l_load.py [--device cuda] [--quick] [--out DIR]   (bash benchmarks/gpu/run.sh l)
"""
from __future__ import annotations

import gc
import json
import resource
import shutil
import time
from pathlib import Path

import report
from report import common

SHAPES = (("tiny-qwen2",), ("qwen2.5-7b", "qwen2.5-14b"))  # quick, full
SHARD = ("2MB", "4GB")
log = common.logger("gpu-l")


def sharded_checkpoint(dst: Path, name: str, device: str, shard: str) -> Path:
    """The shape's random bf16 weights (std 0.02, norms 1, drawn on `device`) as a sharded checkpoint."""
    import torch
    from transformers import AutoModelForCausalLM

    from areal_mq.engines.shapes import _copy_tokenizer, hf_config

    with torch.device(device):
        model = AutoModelForCausalLM.from_config(hf_config(name), dtype=torch.bfloat16)
    gen = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for pname, param in sorted(model.named_parameters()):
            param.fill_(1.0) if pname.endswith("norm.weight") else param.normal_(0.0, 0.02, generator=gen)
    shutil.rmtree(dst, ignore_errors=True)
    model.save_pretrained(str(dst), safe_serialization=True, max_shard_size=shard)
    _copy_tokenizer(dst)
    del model
    _free(device)
    return dst


def _free(device: str) -> None:
    import torch

    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def _device_peak(device: str) -> float:
    import torch

    return round(torch.cuda.max_memory_allocated() / 2**30, 2) if torch.device(device).type == "cuda" else 0.0


def _host_peak() -> float:
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2)


def _available_host_gib() -> float:
    with open("/proc/meminfo") as f:
        return next(int(l.split()[1]) for l in f if l.startswith("MemAvailable")) / 2**20


def choose(model_dir: Path, device: str) -> dict:
    """How this shape can run here, from the plan's arithmetic: device, offload or load only; and its figures."""
    import torch

    from areal_mq.config import config_from_dict
    from areal_mq.launch.plan import GIB, TORCH_BASE, make_plan

    on_cuda = torch.device(device).type == "cuda"
    gib = torch.cuda.get_device_properties(0).total_memory / GIB if on_cuda else None
    base = {"model": {"name": str(model_dir)}, "trainer": {"strategy": "fsdp", "gradient_checkpointing": True,
                                                           "max_tokens_per_mb": 512, "precision": "bf16"},
            "launcher": {"trainer_ranks": 1}}
    plan = make_plan(config_from_dict(base), device_gib=gib, model_dir=model_dir)
    rank = plan.processes[0]
    figures = {"plan_train_gib": round(rank.nbytes / GIB, 2),
               "plan_load_device_gib": round(rank.load["device"] / GIB, 2),  # beyond torch's own
               "plan_load_host_gib": round((TORCH_BASE + rank.load["host"]) / GIB, 2)}
    fits = not [r for r in plan.refusals if r.startswith("a trainer rank")]
    if fits or not on_cuda:
        return {"mode": "device", **figures}
    host_need = 16 * plan.shape.params / GIB + 8
    if host_need < _available_host_gib():
        return {"mode": "offload", "host_need_gib": round(host_need, 1), **figures}
    return {"mode": "load only", "why": f"one step needs {figures['plan_train_gib']} GiB on the device or "
            f"~{host_need:.0f} GiB of host memory with offload; {_available_host_gib():.0f} GiB available", **figures}


def one_shape(name: str, args, shard: str) -> dict:
    from areal_mq.algorithms.config import TrainerConfig
    from areal_mq.algorithms.trainer import Trainer
    from areal_mq.engines.shapes import parameter_count
    from stage_c_trainer import batch

    t0 = time.perf_counter()
    model_dir = sharded_checkpoint(args.work / f"load-{name}", name, args.device, shard)
    out = {"params_b": round(parameter_count(name) / 1e9, 3), "write_s": round(time.perf_counter() - t0, 1),
           "files": len(list(model_dir.glob("*.safetensors")))}
    out.update(choose(model_dir, args.device))
    log(f"{name}: checkpoint in {out['write_s']} s, {out['files']} files; mode {out['mode']}")
    cfg = TrainerConfig(strategy="fsdp", precision="bf16", gradient_checkpointing=True, max_tokens_per_mb=512,
                        lr=1e-7, fsdp={"offload": out["mode"] == "offload", "load": "slices"})
    host_before = _host_peak()
    t0 = time.perf_counter()
    trainer = Trainer(cfg, model_dir, device=args.device, engine_dtype="bfloat16")
    report.sync(trainer.device)
    out.update(load_s=round(time.perf_counter() - t0, 1), load_device_peak_gib=_device_peak(args.device),
               load_host_peak_gib=_host_peak(), host_peak_before_load_gib=host_before)
    if out["mode"] != "load only":
        t0 = time.perf_counter()
        metrics = trainer.train_step(batch(1, 2, 128, 128))
        report.sync(trainer.device)
        out.update(step_s=round(time.perf_counter() - t0, 1), step_device_peak_gib=_device_peak(args.device),
                   step_host_peak_gib=_host_peak(), loss=metrics["loss"])
    log(f"{name}: {json.dumps({k: v for k, v in out.items() if k != 'why'})}")
    del trainer
    _free(args.device)
    shutil.rmtree(model_dir, ignore_errors=True)
    return out


def run(args) -> dict:
    import torch

    q = 0 if args.quick else 1
    shapes = {}
    for name in SHAPES[q]:
        try:
            shapes[name] = one_shape(name, args, SHARD[q])
        except torch.OutOfMemoryError as exc:
            shapes[name] = {"error": f"out of memory: {str(exc)[:200]}"}
            _free(args.device)
    return {"title": "meta-device construction and sharded loading, FSDP2 world 1", "quick": args.quick,
            "machine": report.machine(args.device), "shapes": shapes}


def markdown(r: dict) -> str:
    rows = [("shape", "mode", "load s", "load peak device / host GiB", "plan load device / host GiB",
             "step s", "step peak device / host GiB")]
    for name, x in r["shapes"].items():
        if "error" in x:
            rows.append((name, x["error"], "", "", "", "", ""))
            continue
        rows.append((f"{name} ({x['params_b']}B)", x["mode"], x["load_s"],
                     f"{x['load_device_peak_gib']} / {x['load_host_peak_gib']}",
                     f"{x['plan_load_device_gib']} / {x['plan_load_host_gib']}", x.get("step_s", x.get("why", "")),
                     f"{x.get('step_device_peak_gib', '')} / {x.get('step_host_peak_gib', '')}"))
    return report.table(rows)


def main() -> None:
    report.stage(__doc__, "l", run, markdown)


if __name__ == "__main__":
    main()
