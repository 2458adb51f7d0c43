"""Stage b: the torch engine vs Hugging Face `generate` on the long tail, at 64 and 256 concurrent, plus the
decode-step sweep and prefill rate that fit the simulator's timing slot (fit_sim.py).

What it measures, on SmolLM2-135M's exact config with random weights (random_model.py; speed only):
  longtail  C requests (C = 64, 256) arrive at once; every 8th generates 8L tokens (L = 128: 1,024), the rest
            L; 150-token prompts (the issue's HF reference). The engine refills slots as sequences finish;
            HF generate runs them as one left-padded batch as long as its longest member. Useful tokens/s
            (HF's padding steps are waste), the engine/HF ratio, and the fraction of the memory-bandwidth
            ceiling: a decode step must read the weights once plus every row's KV, so at batch C and mean
            context c the fastest possible step is (weight bytes + C c kv bytes) / HBM bandwidth.
  sweep     decode step time at batch B x context c (B up to 256, c = 256, 1,024): B requests of c-token
            prompts are prefilled, then steps are timed; prefill tokens/s from the same runs.
  ceiling   (issue 42) decode step at batch 1 and 256 x 1,024 context, for SmolLM2-135M's config and for a
            Qwen2.5-1.5B shape (areal_mq/engines/shapes.py, random weights), each against the bandwidth ceiling
            (weight bytes + B c kv bytes) / HBM bandwidth; --quick: batch 1 and 4 x 32 context, tiny shapes.
Targets (issue 25): engine >= 5x HF at 64; >= 10,000 tok/s at 256. Issue 42 (SmolLM2 shape, GPU): decode step
<= 1.0 ms at batch 1 and <= 3 ms at batch 256 x 1,024 (reported in `ceiling`, judged in RESULTS.md).
The engine uses CUDA graphs on CUDA when this tree's engine has them (rollout.engine.cuda_graphs);
STAGE_B_CUDA_GRAPHS=0 measures it without them.

    python benchmarks/gpu/stage_b_engine.py [--device cuda] [--quick] [--out DIR] [--hbm-gbps N]
"""
from __future__ import annotations

import os
import statistics

import report
from report import common

import engine as eb  # benchmarks/speed/engine.py: Workload, Context, the two runners

SIZES = {  # quick, full
    "concurrency": ((4, 8), (64, 256)), "prompt": (12, 150), "short": (4, 128), "long_factor": (4, 8),
    "sweep_batch": ((1, 2, 4), (1, 8, 32, 64, 128, 256)), "sweep_context": ((8, 32), (256, 1024)),
    "sweep_steps": (3, 20), "ceiling_batch": ((1, 4), (1, 256)), "ceiling_context": (32, 1024),
}
TARGETS = {"engine_vs_hf_longtail_64": 5.0, "engine_tokens_per_s_256": 10_000.0}
HBM = {"H200": 4.8e12, "H100 PCIe": 2.0e12, "H100": 3.35e12, "A100": 2.0e12}  # bytes/s, vendor figures
log = common.logger("gpu-b")


def hbm_bytes_per_s(args) -> float | None:
    import torch

    if args.hbm_gbps:
        return args.hbm_gbps * 1e9
    if not torch.cuda.is_available() or "cuda" not in str(args.device):
        return None
    name = torch.cuda.get_device_name()
    return next((bw for key, bw in HBM.items() if all(w in name for w in key.split())), None)


def make_engine(model_dir, args, slots: int, max_len: int):
    from areal_mq.engines.config import EngineConfig
    from areal_mq.engines.torch.engine import TorchEngine

    graphs = "cuda" in str(args.device) and os.environ.get("STAGE_B_CUDA_GRAPHS", "1") != "0"
    extra = {"cuda_graphs": graphs} if "cuda_graphs" in EngineConfig.model_fields else {}
    cfg = EngineConfig(max_concurrent=slots, dtype="bfloat16", seed=0, max_model_len=max_len,
                       max_kv_tokens=slots * max_len, prefill_chunk_tokens=max(128, 4 * max_len), **extra)
    return TorchEngine(model_dir, cfg, dtype="bfloat16", seed=0, device=args.device)


def shape_bytes(engine) -> tuple[float, float]:
    """(weight bytes, KV bytes per token) of the engine's model."""
    c = engine.model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    itemsize = next(engine.model.parameters()).element_size()
    weights = sum(p.numel() * p.element_size() for p in {id(p): p for p in engine.model.parameters()}.values())
    return float(weights), float(2 * c.num_hidden_layers * c.num_key_value_heads * head_dim * itemsize)


def prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    import numpy as np

    rng = np.random.default_rng(seed)
    return [rng.integers(100, min(vocab, 49000), length).tolist() for _ in range(n)]


def longtail(model_dir, tokenizer, hf_model, args, q: int, c: int) -> dict:
    short, factor, plen = SIZES["short"][q], SIZES["long_factor"][q], SIZES["prompt"][q]
    lengths = [short * factor if i % 8 == 3 else short for i in range(c)]
    wl = eb.Workload(f"longtail{c}", prompts(c, plen, len(tokenizer), c), lengths, [0.0] * c)
    engine = make_engine(model_dir, args, c, plen + short * factor + 8)
    ctx = eb.Context(model_dir, tokenizer, hf_model, engine, c)
    warm = eb.Workload("warm", wl.prompts[:c], [2] * c, [0.0] * c)  # every batch bucket / graph once
    for runner in (eb.run_torch_engine, eb.run_hf_generate):
        runner(ctx, warm)
    clock = report.timer(args.device)
    times = {}
    for name, runner in (("torch_engine", eb.run_torch_engine), ("hf_generate", eb.run_hf_generate)):
        t0 = clock()
        runner(ctx, wl)
        times[name] = clock() - t0
        log(f"{wl.name}: {name} {wl.tokens / times[name]:.0f} tok/s ({times[name]:.1f} s)")
    weights, kv = shape_bytes(engine)
    engine.close()
    mean_ctx = plen + statistics.mean(lengths) / 2
    bw = hbm_bytes_per_s(args)
    ceiling = c / ((weights + c * mean_ctx * kv) / bw) if bw else None
    tps = wl.tokens / times["torch_engine"]
    return {"concurrency": c, "tokens": wl.tokens, "prompt": plen, "short": short, "long": short * factor,
            "engine_s": round(times["torch_engine"], 3), "hf_s": round(times["hf_generate"], 3),
            "engine_tokens_per_s": round(tps, 1), "hf_tokens_per_s": round(wl.tokens / times["hf_generate"], 1),
            "engine_vs_hf": round(times["hf_generate"] / times["torch_engine"], 3),
            "bandwidth_ceiling_tokens_per_s": round(ceiling, 1) if ceiling else None,
            "bandwidth_fraction": round(tps / ceiling, 4) if ceiling else None}


def prefill_steps(engine, batch: int, context: int) -> int:
    """Engine steps until `batch` prompts of `context` tokens are all prefilled (a bound): the engine prefills
    at most prefill_chunk_tokens per step and decodes the rows already prefilled in the same steps, so each
    sweep request needs that many tokens of room beyond the timed steps, or the first rows finish before the
    last start (which on a GPU at 128 x 1,024 left the prefill loop spinning on an idle engine)."""
    return -(-batch * context // engine.cfg.prefill_chunk_tokens) + 2


def sweep_point(engine, args, batch: int, context: int, steps: int, vocab: int) -> dict:
    """B requests of `context`-token prompts; time their prefill, then `steps` decode steps of all B rows."""
    from areal_mq.engines.base import EngineRequest
    from areal_mq.messages import SamplingSpec

    clock = report.timer(args.device)
    ids = [f"sw-{batch}-{context}-{i}" for i in range(batch)]
    new_tokens = steps + 8 + prefill_steps(engine, batch, context)  # rows prefilled first decode meanwhile
    t0 = clock()
    for i, (rid, p) in enumerate(zip(ids, prompts(batch, context, vocab, batch * 7 + context))):
        engine.submit(EngineRequest(rid, p, SamplingSpec(temperature=1.0, max_new_tokens=new_tokens,
                                                         ignore_eos=True, seed=i)))
    before = engine.stats()["generated_tokens"]
    while True:  # prefill (in chunks) until one step decodes every row
        if not engine.has_work():
            raise RuntimeError(f"sweep {batch} x {context}: rows finished before every row was prefilled")
        engine.step()
        now = engine.stats()["generated_tokens"]
        if now - before == batch:
            break
        before = now
    prefill_s = clock() - t0
    engine.step()  # a first full step (graph capture of this bucket on CUDA)
    t1 = clock()
    for _ in range(steps):
        engine.step()
    step_s = (clock() - t1) / steps
    for rid in ids:
        engine.abort(rid)
    while engine.has_work():
        engine.step()
    return {"batch": batch, "context": context, "step_s": round(step_s, 6), "prefill_tokens": batch * context,
            "prefill_s": round(prefill_s, 4)}


def ceiling(model_dir, name: str, args, q: int, vocab: int) -> list[dict]:
    """Decode step at the ceiling batches x context on one model shape, with the bandwidth ceiling of each point."""
    batches, context, steps = SIZES["ceiling_batch"][q], SIZES["ceiling_context"][q], SIZES["sweep_steps"][q]
    engine = make_engine(model_dir, args, max(batches), context + steps + 16 + max(batches) // 4 + 4)
    weights, kv = shape_bytes(engine)
    hbm = hbm_bytes_per_s(args)
    points = []
    for b in batches:
        point = sweep_point(engine, args, b, context, steps, vocab)
        floor_s = (weights + b * context * kv) / hbm if hbm else None
        points.append({"shape": name, **point, "weight_bytes": weights, "kv_bytes_per_token": kv,
                       "ceiling_step_s": round(floor_s, 7) if floor_s else None,
                       "bandwidth_fraction": round(floor_s / point["step_s"], 4) if floor_s else None})
    engine.close()
    return points


def ceiling_shapes(args, smollm2_dir) -> list[tuple[str, object]]:
    """(name, model dir) of the shapes the ceiling section measures: SmolLM2's config and Qwen2.5-1.5B's."""
    from areal_mq.engines.shapes import build_random_model

    qwen = ("qwen2.5-1.5b", build_random_model(args.work / ("qwen2.5-1.5b-random" + ("-quick" if args.quick else "")),
                                               "qwen2.5-1.5b", dtype="bfloat16",
                                               **(dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                                       num_attention_heads=4, num_key_value_heads=2,
                                                       vocab_size=49152) if args.quick else {})))
    return [("smollm2-135m", smollm2_dir), qwen]


def run(args) -> dict:
    import torch

    from areal_mq.engines.models import load_causal_lm, load_tokenizer
    from random_model import build, describe

    q = 0 if args.quick else 1
    model_dir = build(args.work / ("smollm2-random-quick" if args.quick else "smollm2-random"), args.quick,
                      report.PACK / "smollm2")
    tokenizer = load_tokenizer(model_dir)
    hf_model = load_causal_lm(model_dir, "bfloat16", args.device)
    rows = [longtail(model_dir, tokenizer, hf_model, args, q, c) for c in SIZES["concurrency"][q]]
    del hf_model
    contexts, batches = SIZES["sweep_context"][q], SIZES["sweep_batch"][q]
    # room for the timed steps and the decoding done while the other rows prefill: make_engine's chunk is
    # at least 4 x max_len >= 4 x context tokens, so prefill_steps <= batch / 4 + 3
    engine = make_engine(model_dir, args, max(batches),
                         max(contexts) + SIZES["sweep_steps"][q] + 16 + max(batches) // 4 + 4)
    weights, kv = shape_bytes(engine)
    sweep = [sweep_point(engine, args, b, c, SIZES["sweep_steps"][q], len(tokenizer)) for c in contexts for b in batches]
    engine.close()
    points = [p for name, d in ceiling_shapes(args, model_dir) for p in ceiling(d, name, args, q, len(tokenizer))]
    big = max(sweep, key=lambda r: r["prefill_tokens"])
    by_c = {r["concurrency"]: r for r in rows}
    lo, hi = SIZES["concurrency"][q]
    ratios = {"engine_vs_hf_longtail_64": by_c[lo]["engine_vs_hf"],
              "engine_tokens_per_s_256": by_c[hi]["engine_tokens_per_s"]}
    return {"title": "engine vs HF generate, long tail", "quick": args.quick, "machine": report.machine(args.device),
            "model": {**describe(model_dir, args.quick), "weight_bytes": weights, "kv_bytes_per_token": kv,
                      "dtype": "bfloat16"}, "hbm_bytes_per_s": hbm_bytes_per_s(args), "longtail": rows,
            "decode_sweep": sweep, "ceiling": points, "prefill_tokens_per_s": round(big["prefill_tokens"] / big["prefill_s"], 1),
            "ratios": ratios, "targets": TARGETS, "torch_threads": torch.get_num_threads(),
            "cuda_graphs": "cuda" in str(args.device) and os.environ.get("STAGE_B_CUDA_GRAPHS", "1") != "0"}


def markdown(r: dict) -> str:
    rows = [("concurrency", "tokens", "engine tok/s", "HF tok/s", "engine/HF", "of bandwidth ceiling")]
    rows += [(x["concurrency"], x["tokens"], x["engine_tokens_per_s"], x["hf_tokens_per_s"], x["engine_vs_hf"],
              f"{x['bandwidth_fraction']:.1%}" if x["bandwidth_fraction"] is not None else "- (no HBM figure)")
             for x in r["longtail"]]
    t = r["targets"]
    rows += [("target", "", "", "", f"engine/HF at {r['longtail'][0]['concurrency']} >= {t['engine_vs_hf_longtail_64']}: "
              f"{report.verdict(r['ratios']['engine_vs_hf_longtail_64'], t['engine_vs_hf_longtail_64'])}",
              f"tok/s at {r['longtail'][-1]['concurrency']} >= {t['engine_tokens_per_s_256']:.0f}: "
              f"{report.verdict(r['ratios']['engine_tokens_per_s_256'], t['engine_tokens_per_s_256'])}")]
    sweep = [("batch", "context", "decode step ms", "prefill tok/s")]
    sweep += [(s["batch"], s["context"], f"{s['step_s'] * 1e3:.2f}", f"{s['prefill_tokens'] / s['prefill_s']:.0f}")
              for s in r["decode_sweep"]]
    ceil = [("shape", "batch", "context", "decode step ms", "ceiling ms", "of ceiling")]
    ceil += [(c["shape"], c["batch"], c["context"], f"{c['step_s'] * 1e3:.2f}",
              "-" if c["ceiling_step_s"] is None else f"{c['ceiling_step_s'] * 1e3:.3f}",
              "- (no HBM figure)" if c["bandwidth_fraction"] is None else f"{c['bandwidth_fraction']:.1%}")
             for c in r.get("ceiling", [])]
    return (report.table(rows) + f"\n\nmodel: {r['model']['name']} ({r['model']['weights']})\n\n" + report.table(sweep)
            + "\n\n" + report.table(ceil))


def main() -> None:
    report.stage(__doc__, "b", run, markdown, lambda p: p.add_argument(
        "--hbm-gbps", type=float, default=None, help="HBM bandwidth in GB/s (default: by GPU name)."))


if __name__ == "__main__":
    main()
