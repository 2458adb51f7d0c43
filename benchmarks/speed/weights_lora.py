"""`python benchmarks/speed/weights.py --lora`: a LoRA adapter version against a full version, side by side (issue 53).

What it measures, per model (quick: the tiny random Llama; full: SmolLM2-135M-Instruct's real weights and the
Qwen2.5-0.5B shape with seeded random weights), with a rank-16 all-linear adapter (random A and B, so the merge does
real work) and the torch engine in fp32 as the quickstart runs it:
- bytes per update: what travels for a version (WeightsChunk payloads from areal_mq/weights/codec.py) in the
  published dtype (bf16), the full state dict (tied tensors once) against the adapter's A and B;
- the engine's pause: TorchEngine.update_weights for the full version (the copy of every tensor) against the
  adapter's (the in-place copies of the merged weights), alternating, ROUNDS times each; the adapter's merge from
  the kept base (stage_adapter, on the rollout worker's fetch thread, not in the pause) is reported beside it.
- the engine's choice, merged or not (issue 53 item 3): a decode step of DECODE_ROWS rows (HF forward with its KV
  cache, fp32 as the quickstart's engine) with the adapter merged into the weights against the same adapter kept
  as an extra low-rank product per linear (PEFT's unmerged forward), alternating, ROUNDS times; and the rounding
  of each in bf16 (the GPU engines' dtype): the largest and mean |logprob| error of the prompt's next-token
  distribution against the fp32 merged reference, merged once in fp32 then cast (what the engine does) against a
  bf16 base plus a bf16 low-rank product.
Ratios (larger is better): full_vs_lora_update_bytes (target 50 on the 0.5B shape) and full_vs_lora_pause (target
1.0: an adapter's pause no larger than a full update's), medians over the rounds; unmerged_vs_merged_decode (a
decode step's time unmerged over merged; reported, no target).

    python benchmarks/speed/weights.py --lora [--quick] [--json PATH] [--threads N]
"""
from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py (it adds the kinds' folders)
import common  # noqa: E402

log = common.logger("weights-lora")
TARGETS = {"full_vs_lora_update_bytes": 50.0, "full_vs_lora_pause": 1.0}
RANK, ALPHA = 16, 32.0
DECODE_ROWS, DECODE_PROMPT, DECODE_STEPS = 16, 32, 8
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
SIZES = {"models": (("tiny-random-llama",), ("smollm2-135m-instruct", "qwen2.5-0.5b")), "rounds": (2, 5)}


def model_dir(name: str) -> Path:
    from areal_mq.engines.models import resolve_model
    from areal_mq.engines.shapes import SHAPES, build_random_model

    if name in SHAPES:
        cache = Path(os.environ.get("AREAL_MQ_CACHE", Path.home() / ".cache" / "areal-mq")) / "bench-models"
        return build_random_model(cache / f"{name}-random", name, seed=0)
    return resolve_model(name)


def random_adapter(model: Any, seed: int) -> dict[str, Any]:
    import torch

    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, p in model.named_parameters():
        module = name.removesuffix(".weight")
        if name.endswith(".weight") and module.rsplit(".", 1)[-1] in LINEARS:
            out[module + ".lora_A.weight"] = torch.randn(RANK, p.shape[1], generator=g) * 0.01
            out[module + ".lora_B.weight"] = torch.randn(p.shape[0], RANK, generator=g) * 0.01
    return out


def wire_bytes(tensors: dict[str, Any]) -> int:
    from areal_mq.weights.codec import make_chunks

    return sum(sum(int(b.nbytes) for b in c.tensors) for c in make_chunks(1, tensors, 64 << 20))


def measure(name: str, rounds: int) -> dict:
    import torch

    from areal_mq.engines.config import EngineConfig
    from areal_mq.engines.torch.engine import TorchEngine
    from areal_mq.weights.codec import unique_tensors

    engine = TorchEngine(model_dir(name), EngineConfig(seed=0, dtype="float32"))
    full = unique_tensors(engine.model.state_dict(), "bfloat16")
    params = sum(t.numel() for t in full.values())
    pauses: dict[str, list[float]] = {"full": [], "lora": [], "lora_stage": []}
    version = 0
    adapter = {}
    for r in range(rounds):
        version += 1
        t0 = time.perf_counter()
        engine.update_weights(version, tensors=full)
        pauses["full"].append(time.perf_counter() - t0)
        adapter = unique_tensors(random_adapter(engine.model, seed=r), "bfloat16")
        t0 = time.perf_counter()
        staged = engine.stage_adapter(adapter, ALPHA / RANK)
        pauses["lora_stage"].append(time.perf_counter() - t0)
        version += 1
        t0 = time.perf_counter()
        engine.update_weights(version, adapter=staged)
        pauses["lora"].append(time.perf_counter() - t0)
        log(f"{name} round {r + 1}/{rounds}: full {pauses['full'][-1]:.3f}s, adapter {pauses['lora'][-1]:.3f}s "
            f"(+ merge off the pause {pauses['lora_stage'][-1]:.3f}s)")
    full_bytes, lora_bytes = wire_bytes(full), wire_bytes(adapter)
    med = {k: statistics.median(v) for k, v in pauses.items()}
    del engine
    torch.set_num_threads(torch.get_num_threads())
    return {"model": name, "params": params, "adapter_params": sum(t.numel() for t in adapter.values()),
            "full_bytes": full_bytes, "lora_bytes": lora_bytes, "pause_s": pauses, "median_s": med,
            "full_vs_lora_update_bytes": round(full_bytes / lora_bytes, 2),
            "full_vs_lora_pause": round(med["full"] / med["lora"], 3)}


def _adapted(model_path: Path, adapter: dict[str, Any], dtype: Any, merged: bool) -> Any:
    """The HF model in `dtype` with `adapter` merged into its weights (fp32 product, cast once: the engine's merge)
    or attached unmerged through PEFT (its lora_A/lora_B in `dtype`, an extra product per linear)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from areal_mq.weights.adapter import merged as merge_one

    model = AutoModelForCausalLM.from_pretrained(str(model_path), torch_dtype=torch.float32).eval()
    if merged:
        params = dict(model.named_parameters())
        with torch.no_grad():
            for key in [k for k in adapter if k.endswith(".lora_A.weight")]:
                module = key.removesuffix(".lora_A.weight")
                w = params[module + ".weight"]
                w.copy_(merge_one(w, adapter[key], adapter[module + ".lora_B.weight"], ALPHA / RANK))
        return model.to(dtype)
    model = get_peft_model(model.to(dtype), LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=list(LINEARS)))
    state = {k.replace(".lora_A.weight", ".lora_A.default.weight").replace(".lora_B.weight", ".lora_B.default.weight"):
             v for k, v in adapter.items()}
    missing = model.base_model.model.load_state_dict(state, strict=False).unexpected_keys
    assert not missing, missing[:3]
    return model.to(dtype).eval()


def decode_cost(name: str, rounds: int) -> dict:
    """Merged against unmerged: a decode step's time (fp32) and the bf16 rounding (module docstring)."""
    import torch

    path = model_dir(name)
    probe = _adapted(path, {}, torch.float32, merged=True)
    adapter = {k: v.float() for k, v in random_adapter(probe, seed=7).items()}
    vocab = probe.config.vocab_size
    del probe
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, vocab, (DECODE_ROWS, DECODE_PROMPT), generator=g)
    models = {way: _adapted(path, adapter, torch.float32, merged=way == "merged") for way in ("merged", "unmerged")}
    steps: dict[str, list[float]] = {"merged": [], "unmerged": []}
    with torch.no_grad():
        for _ in range(rounds):
            for way, model in models.items():
                out = model(prompt, use_cache=True)
                past, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
                for _ in range(DECODE_STEPS):
                    t0 = time.perf_counter()
                    out = model(token, past_key_values=past, use_cache=True)
                    steps[way].append(time.perf_counter() - t0)
                    past, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
        reference = torch.log_softmax(models["merged"](prompt).logits[:, -1].float(), -1)
        del models
        errors = {}
        for way in ("merged", "unmerged"):
            model = _adapted(path, adapter, torch.bfloat16, merged=way == "merged")
            err = (torch.log_softmax(model(prompt).logits[:, -1].float(), -1) - reference).abs()
            errors[way] = {"max": round(float(err.max()), 4), "mean": round(float(err.mean()), 5)}
            del model
    med = {k: statistics.median(v) for k, v in steps.items()}
    log(f"{name} decode step: merged {med['merged'] * 1e3:.1f} ms, unmerged {med['unmerged'] * 1e3:.1f} ms; "
        f"bf16 |logprob| error max merged {errors['merged']['max']} unmerged {errors['unmerged']['max']}")
    return {"rows": DECODE_ROWS, "prompt": DECODE_PROMPT, "steps_per_round": DECODE_STEPS, "step_s": steps,
            "median_step_s": med, "bf16_logprob_error": errors,
            "unmerged_vs_merged_decode": round(med["unmerged"] / med["merged"], 3)}


def run(args: Any) -> dict:
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    q = 0 if args.quick else 1
    rows = [{**measure(name, SIZES["rounds"][q]), "decode": decode_cost(name, SIZES["rounds"][q])}
            for name in SIZES["models"][q]]
    main_row = rows[-1]  # the largest model measured: the targets are on the 0.5B shape
    return {"benchmark": "weights", "mode": "lora", "quick": args.quick, "machine": common.torch_machine(),
            "rank": RANK, "alpha": ALPHA, "dtype_published": "bfloat16", "engine_dtype": "float32", "models": rows,
            "ratios": {"full_vs_lora_update_bytes": main_row["full_vs_lora_update_bytes"],
                       "full_vs_lora_pause": main_row["full_vs_lora_pause"],
                       "unmerged_vs_merged_decode": main_row["decode"]["unmerged_vs_merged_decode"]},
            "ratios_per_model": {r["model"]: {k: r[k] for k in TARGETS} for r in rows}, "targets": TARGETS}


def table(report: dict, command: str) -> str:
    rows = [("model", "params", "adapter", "full MB", "adapter MB", "bytes ratio", "full pause s", "adapter pause s",
             "merge s (off pause)", "pause ratio")]
    for r in report["models"]:
        m = r["median_s"]
        rows.append((r["model"], f"{r['params'] / 1e6:.0f}M", f"{r['adapter_params'] / 1e6:.2f}M",
                     f"{r['full_bytes'] / 1e6:.1f}", f"{r['lora_bytes'] / 1e6:.2f}", f"{r['full_vs_lora_update_bytes']:.1f}",
                     f"{m['full']:.3f}", f"{m['lora']:.3f}", f"{m['lora_stage']:.3f}", f"{r['full_vs_lora_pause']:.2f}"))
    lines = common.align(rows)
    lines.append("")
    rows = [("model", "decode step merged ms", "unmerged ms", "ratio", "bf16 |logprob| err merged (max/mean)",
             "unmerged (max/mean)")]
    for r in report["models"]:
        d = r["decode"]
        m, e = d["median_step_s"], d["bf16_logprob_error"]
        rows.append((r["model"], f"{m['merged'] * 1e3:.1f}", f"{m['unmerged'] * 1e3:.1f}",
                     f"{d['unmerged_vs_merged_decode']:.2f}", f"{e['merged']['max']} / {e['merged']['mean']}",
                     f"{e['unmerged']['max']} / {e['unmerged']['mean']}"))
    lines += common.align(rows)
    lines.append("")
    lines += [f"{k} {v} (target {TARGETS[k]}: {common.met(v, TARGETS[k])})" if k in TARGETS else
              f"{k} {v} (reported, no target)" for k, v in report["ratios"].items()]
    lines.append(f"command: {command}")
    return "\n".join(lines)


def main(args: Any) -> None:
    report = common.timed(run, args)
    command = "python benchmarks/speed/weights.py --lora" + (" --quick" if args.quick else "")
    report["command"] = command
    common.finish(report, args.json, table(report, command))
