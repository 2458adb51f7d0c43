"""`python benchmarks/speed/engine.py --admission`: does the paged torch engine fill its KV pool with rows (issue 59)?

What: one SmolLM2 engine of 64 rows and a 2 GiB KV pool (a node layout's shape at CPU size: every row may write
8,000 tokens, far more than the pool holds for all of them at once) is given 64 requests of max_new_tokens 8,000 and
decodes a few steps under two admission rules, alternating in one run:
  pool      the rule today (areal_mq/engines/admission.py): slots and the pool decide, no reservation cap;
  reserved  the rule before issue 59: running rows' prompt + max_new_tokens under 65,536 (max_reserved_tokens set to
            the old default), which ran 8 and kept 56 waiting while 8 of 2,911 blocks were in use.
Each side reports rows running, waiting, blocks used and the mean live tokens per row after its steps.
A third side runs the pool rule on a pool too small for the rows (64 MiB, ~2,900 tokens; max_new_tokens 2,000 so a
request fits the whole pool): rows grow until it is full and the youngest are preempted from then on.
Ratios (larger is better): pool_admission_fill = rows running / min(max_concurrent, pool tokens / mean live tokens)
for the pool rule, the smaller of its two sides (target 0.9: the engine runs the rows its pool holds);
pool_vs_reserved_rows = rows running under the pool rule / under the old cap.

    python benchmarks/speed/engine.py --admission [--quick] [--json PATH]
"""
from __future__ import annotations

import time

import common

log = common.logger("engine-admission")
ROWS, POOL_BYTES, MAX_NEW, OLD_CAP = 64, 2 << 30, 8000, 65536
STEPS = (6, 24)  # quick, full
SMALL_POOL, SMALL_STEPS, SMALL_NEW = 64 << 20, (25, 120), 2000  # a request must fit the whole pool


def one_side(model_dir, tokenizer, args, cap: int | None, steps: int, pool_bytes: int = POOL_BYTES,
             rule: str = "", max_new: int = MAX_NEW) -> dict:
    from areal_mq.engines.base import EngineRequest
    from areal_mq.engines.config import EngineConfig
    from areal_mq.engines.models import apply_chat_template
    from areal_mq.messages import SamplingSpec
    from areal_mq.engines.torch.engine import TorchEngine

    cfg = EngineConfig(max_concurrent=ROWS, dtype=args.dtype, seed=0, kv_cache_bytes=pool_bytes,
                       max_model_len=max_new + 512, max_reserved_tokens=cap)
    engine = TorchEngine(model_dir, cfg, dtype=args.dtype, tokenizer=tokenizer, device=args.device)
    for i in range(ROWS):
        prompt = apply_chat_template(tokenizer, f"Problem {i}: add the numbers from 1 to {i + 10} and explain.")
        engine.submit(EngineRequest(f"r{i}", prompt, SamplingSpec(temperature=1.0, max_new_tokens=max_new,
                                                                  ignore_eos=True, seed=i)))
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    seconds = time.perf_counter() - start
    st = engine.stats()
    live = [s.kv_len for s in engine.rows]
    mean_live = sum(live) / max(1, len(live))
    pool_rows = st["kv_capacity_tokens"] / max(1.0, mean_live)
    engine.close()
    return {"rule": rule or ("reserved" if cap else "pool"), "max_reserved_tokens": cap, "steps": steps,
            "seconds": seconds, "running": st["running"], "waiting": st["waiting"], "kv_blocks": st["kv_blocks"],
            "preempted": st["preempted"],
            "kv_blocks_used": st["kv_blocks_used"], "pool_tokens": st["kv_capacity_tokens"],
            "mean_live_tokens": round(mean_live, 1), "fill": st["running"] / min(ROWS, pool_rows)}


def run(args) -> dict:
    import torch

    from areal_mq.engines.models import load_tokenizer, resolve_model

    torch.set_num_threads(args.threads or 1)
    model_dir = resolve_model(args.model)
    tokenizer = load_tokenizer(model_dir)
    steps = STEPS[0 if args.quick else 1]
    results = []
    for cap in (None, OLD_CAP):  # the two rules one after the other in one process: rows, not speed, are compared
        log(f"{'pool rule' if cap is None else f'reservation cap {cap}'}: {ROWS} requests of {MAX_NEW} new tokens")
        results.append(one_side(model_dir, tokenizer, args, cap, steps))
    # a pool too small for the rows (64 MiB: ~2,900 tokens of SmolLM2 bf16): rows grow until it is full, then the
    # youngest are preempted; the rule must keep running what the pool holds, not fewer
    log(f"pool rule, a {SMALL_POOL >> 20} MiB pool: the pool binds before the slots")
    results.append(one_side(model_dir, tokenizer, args, None, SMALL_STEPS[0 if args.quick else 1], SMALL_POOL,
                            "pool (64 MiB pool, 2,000 new tokens)", SMALL_NEW))
    pool, reserved, small = results
    ratios = {"pool_admission_fill": round(min(pool["fill"], small["fill"]), 4),
              "pool_vs_reserved_rows": round(pool["running"] / max(1, reserved["running"]), 3)}
    return {"benchmark": "engine", "mode": "admission", "quick": args.quick,
            "machine": common.torch_machine(threads=torch.get_num_threads(), model=args.model, dtype=args.dtype,
                                            device=common.device_name(args.device)),
            "results": results, "ratios": ratios, "targets": {"pool_admission_fill": 0.9}}


def table(report: dict, command: str) -> str:
    rows = [("rule", "running", "waiting", "blocks used", "mean live tokens", "fill", "preempted")]
    for r in report["results"]:
        rows.append((r["rule"] + (f" (cap {r['max_reserved_tokens']})" if r["max_reserved_tokens"] else ""),
                     str(r["running"]), str(r["waiting"]), f"{r['kv_blocks_used']} of {r['kv_blocks']}",
                     f"{r['mean_live_tokens']:.0f}", f"{r['fill']:.3f}", str(r["preempted"])))
    rows += [("", "", "", "", "", "", ""), *[(*row, "", "", "", "") for row in common.ratio_rows(report)]]
    return "\n".join(common.align(rows, rule=False) + [f"reproduce: {command}"])
