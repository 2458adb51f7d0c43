"""`python benchmarks/speed/engine.py --reasoning`: the torch engine's paged KV against the contiguous KV it replaced
(issue 42), at one fixed KV memory budget, on a reasoning-shaped long tail, in the same run.

Workload: groups of 8 samples sharing one prompt of PROMPT_TOKENS tokens (a GRPO group); in each group one sample
generates LONG tokens and seven SHORT (1 in 8 long: the reasoning tail); all requests arrive at once, as a
rollout batch does, more of them than either engine holds at once. Full: 4 groups, LONG 2,048 and SHORT 256;
--quick: 4 groups, 512 and 64.

Budget: what the contiguous engine (benchmarks/baselines/contiguous_engine, the package's engine before issue 42) needs for
CONTIGUOUS_SLOTS slots of the longest request (+ its scratch slot): every slot reserves prompt + LONG positions,
whether its answer is short or long. The paged engine gets the same bytes as its block pool (kv_cache_bytes) and a
high max_concurrent: how many sequences it holds is decided by the blocks they use, with the youngest preempted
(and recomputed) if the pool runs out.

Measured per engine: wall seconds until every request finished, generated tokens/s, concurrency = mean running
sequences, weighted by step time, over the steps taken while requests were still waiting (the saturated part;
the max too; an engine that was never saturated held every request at once, and its concurrency is their number,
a lower bound),
preemptions and KV blocks; then, on the paged engine, the logprob gap `kv_on_update: keep` leaves after one
Adam-like weight step (`update_gap`). Ratios (larger is better): contiguous_vs_paged_concurrency = paged / contiguous
concurrency (target 4), paged_vs_contiguous_tokens_per_s (target 1.0).
"""
from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py (it adds the kinds' folders)
import common  # noqa: E402

log = common.logger("engine")

TARGETS = {"contiguous_vs_paged_concurrency": 4.0, "paged_vs_contiguous_tokens_per_s": 1.0}
GROUP, PROMPT_TOKENS, CONTIGUOUS_SLOTS, PAGED_MAX_CONCURRENT = 8, 150, 4, 64
# quick, full
SIZES = {"groups": (4, 4), "long": (512, 2048), "short": (64, 256)}
TEXT = ("Solve the problem step by step, checking each step before the next. A train leaves the station at "
        "nine with 120 passengers; at each of the next stops a quarter of them leave and 14 board. ")


def workload(tokenizer: Any, q: int) -> list[tuple[list[int], int]]:
    """(prompt ids, tokens to generate) per request: groups of 8 on one PROMPT_TOKENS-token prompt, one long each."""
    from areal_mq.engines.models import apply_chat_template

    requests = []
    for g in range(SIZES["groups"][q]):
        ids = apply_chat_template(tokenizer, f"(problem {g}) " + TEXT * 8)
        prompt = ids[: PROMPT_TOKENS - 5] + ids[-5:]  # keep the template's assistant turn at the end
        for k in range(GROUP):
            requests.append((prompt, SIZES["long"][q] if k == 3 else SIZES["short"][q]))
    return requests


def drive(engine: Any, requests: list[tuple[list[int], int]], tag: str) -> dict:
    """Submit every request, step until all finished; tokens/s and concurrency as in the module docstring."""
    from areal_mq.engines.base import EngineRequest
    from areal_mq.messages import SamplingSpec

    start = time.perf_counter()
    for i, (prompt, n) in enumerate(requests):
        sp = SamplingSpec(temperature=1.0, max_new_tokens=n, ignore_eos=True, seed=i)
        engine.submit(EngineRequest(f"{tag}-{i}-{start}", prompt, sp))
    held = [0.0, 0.0]  # sum of running x step seconds, and of step seconds, while requests were waiting
    running, outputs, t = [], 0, time.perf_counter()
    while engine.has_work():
        outputs += len(engine.step())
        stats, now = engine.stats(), time.perf_counter()
        running.append(stats["running"])
        if stats["waiting"]:
            held[0] += stats["running"] * (now - t)
            held[1] += now - t
        t = now
    seconds = time.perf_counter() - start
    assert outputs == len(requests), (outputs, len(requests))
    stats = engine.stats()
    tokens = sum(n for _, n in requests)
    return {"seconds": round(seconds, 2), "tokens": tokens, "tokens_per_s": round(tokens / seconds, 1),
            # never saturated: every request was held at once, a lower bound of what it can hold
            "concurrency": round(held[0] / held[1], 2) if held[1] else float(len(requests)), "saturated": held[1] > 0,
            "mean_running": round(statistics.mean(running), 2),
            "max_running": max(running), "steps": len(running), "preempted": stats.get("preempted", 0),
            "kv_blocks_peak": stats.get("kv_blocks_peak", "-"), "kv_bytes": stats["kv_bytes"]}


def engines(args: Any, q: int) -> tuple[dict, int]:
    """The two engines at one KV budget (bytes) and that budget."""
    import torch
    from transformers import AutoConfig

    from contiguous_engine import ContiguousEngine

    from areal_mq.engines.config import EngineConfig
    from areal_mq.engines.models import load_tokenizer, resolve_model
    from areal_mq.engines.torch.engine import TorchEngine
    from areal_mq.engines.torch.kvcache import bytes_per_token

    if args.threads:
        torch.set_num_threads(args.threads)
    model_dir = resolve_model(args.model)
    tok = load_tokenizer(model_dir)
    max_len = PROMPT_TOKENS + SIZES["long"][q]
    base = dict(dtype=args.dtype, seed=0, max_model_len=max_len, max_kv_tokens=10**7)
    config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    per_token = bytes_per_token(config.num_hidden_layers, config.num_key_value_heads, head_dim,
                                getattr(torch, args.dtype))
    budget = (CONTIGUOUS_SLOTS + 1) * max_len * per_token
    out = {
        "paged": TorchEngine(model_dir, EngineConfig(**base, max_concurrent=PAGED_MAX_CONCURRENT, kv_cache_bytes=budget),
                             dtype=args.dtype, tokenizer=tok, device=args.device),
        "contiguous": ContiguousEngine(model_dir, EngineConfig(**base, max_concurrent=CONTIGUOUS_SLOTS,
                                                               kv_cache_bytes=budget),
                                       dtype=args.dtype, tokenizer=tok, device=args.device),
    }
    return out, budget


def update_gap(engine: Any, requests: list[tuple[list[int], int]], q: int) -> list[dict]:
    """The logprob gap `kv_on_update: keep` leaves (update_gap.py), for one Adam-like step of the weights: every
    parameter moved by lr in a random direction (lr = 1e-6, 1e-5: what one RL step at those learning rates moves
    each weight at most; lr = 0 measures the floor: KV written token by token vs recomputed in one prefill differ
    by rounding alone, which in bfloat16 is most of the gap), on 8 rows mid-generation ((64, 256) tokens in).
    Weights are restored after each."""
    import torch

    from areal_mq.engines.base import EngineRequest
    from areal_mq.messages import SamplingSpec

    before = {k: v.detach().clone() for k, v in engine.model.named_parameters()}
    engine.cfg = engine.cfg.model_copy(update={"kv_on_update": "keep", "kv_gap_rows": 8})
    gen, rows = torch.Generator().manual_seed(0), []
    for lr in (0.0, 1e-6, 1e-5):  # 0: the same weights, the floor (decode-written vs prefill-written KV rounding)
        ids = [f"gap-{lr}-{i}" for i in range(8)]
        for i, rid in enumerate(ids):
            engine.submit(EngineRequest(rid, requests[8 * i % len(requests)][0],
                                        SamplingSpec(temperature=1.0, max_new_tokens=400, ignore_eos=True, seed=i)))
        for _ in range((64, 256)[q]):
            engine.step()
        moved = {k: v + lr * torch.randn(v.shape, generator=gen).sign().to(v.dtype) for k, v in before.items()}
        gap = engine.update_weights(engine.version + 1, tensors=moved)
        rows.append({"lr": lr, "tokens_in": (64, 256)[q], **{k: v for k, v in gap.items() if k.startswith("gap")}})
        for rid in ids:
            engine.abort(rid)
        engine.update_weights(engine.version + 1, tensors=before)
    engine.cfg = engine.cfg.model_copy(update={"kv_gap_rows": 0})
    return rows


def run(args: Any) -> dict:
    q = 0 if args.quick else 1
    built, budget = engines(args, q)
    requests = workload(built["paged"].tokenizer, q)
    for name, engine in built.items():  # warm-up: one short request each
        drive(engine, [(requests[0][0], 4)], f"warm-{name}")
    results = {}
    for name in ("paged", "contiguous"):
        results[name] = drive(built[name], requests, name)
        log(f"reasoning {name:10s} {results[name]['tokens_per_s']:7.1f} tok/s, concurrency "
            f"{results[name]['concurrency']}, {results[name]['seconds']}s")
    gaps = update_gap(built["paged"], requests, q)
    log(f"keep's logprob gap: {gaps}")
    for engine in built.values():
        engine.close()
    paged, contiguous = results["paged"], results["contiguous"]
    ratios = {"contiguous_vs_paged_concurrency": round(paged["concurrency"] / contiguous["concurrency"], 2),
              "paged_vs_contiguous_tokens_per_s": round(paged["tokens_per_s"] / contiguous["tokens_per_s"], 3)}
    import torch

    machine = common.torch_machine(threads=torch.get_num_threads(), model=args.model, dtype=args.dtype,
                                   device=common.device_name(args.device))
    return {"benchmark": "engine", "mode": "reasoning", "quick": args.quick, "machine": machine,
            "workload": {"groups": SIZES["groups"][q], "group": GROUP, "prompt_tokens": PROMPT_TOKENS,
                         "long": SIZES["long"][q], "short": SIZES["short"][q], "kv_budget_bytes": budget,
                         "contiguous_slots": CONTIGUOUS_SLOTS, "paged_max_concurrent": PAGED_MAX_CONCURRENT},
            "results": [{"engine": name, **r} for name, r in results.items()], "keep_gap": gaps, "ratios": ratios,
            "targets": TARGETS}


def table(report: dict, command: str) -> str:
    w = report["workload"]
    rows = [("engine (KV budget %.0f MiB)" % (w["kv_budget_bytes"] / 2**20), "tokens/s", "concurrency (max)",
             "seconds", "steps", "preempted", "peak blocks")]
    for r in report["results"]:
        held = f"{r['concurrency']}" + ("" if r["saturated"] else " (all held)")
        rows.append((r["engine"], f"{r['tokens_per_s']:.1f}", f"{held} ({r['max_running']})",
                     f"{r['seconds']:.1f}", str(r["steps"]), str(r["preempted"]), str(r["kv_blocks_peak"])))
    lines = common.align(rows, rule=False) + [""] + common.align(common.ratio_rows(report), rule=False)
    lines += [""] + common.align([("kv_on_update: keep after one step at lr", "rows", "tokens in", "|dlogprob| mean",
                                   "max", "KL mean")] + [
        (f"{g['lr']:g}", f"{g.get('gap_rows', 0):.0f}", str(g["tokens_in"]), f"{g.get('gap_logprob_mean', 0):.2e}",
         f"{g.get('gap_logprob_max', 0):.2e}", f"{g.get('gap_kl_mean', 0):.2e}") for g in report["keep_gap"]], rule=False)
    m = report["machine"]
    lines.append(f"workload: {w['groups']} groups of {w['group']} on {w['prompt_tokens']}-token prompts, 1 in 8 "
                 f"generating {w['long']} tokens, the rest {w['short']}; machine: {m['cpus']} cpus, {m['threads']} "
                 f"torch threads, {m['dtype']}, load at start {m['loadavg_at_start'][0]:.1f}")
    return "\n".join(lines + [f"reproduce: {command}"])
