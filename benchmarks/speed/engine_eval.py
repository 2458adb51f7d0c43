"""`python benchmarks/speed/engine.py --eval`: the quickstart's held-out evaluation on the paged torch engine against the
contiguous KV engine it replaced (benchmarks/baselines/contiguous_engine), alternating in one run (issue 51, item 4).

The workload is the main job's own: configs/quickstart.yaml's held-out problems (200; 32 with --quick), its prompt
(worked examples in the chat), greedy, its length cap (64 new tokens; 16 with --quick), 128 requests decoded at once
(evaluation/heldout.py EVAL_BATCH), in the quickstart's dtype (fp32). Both engines must return the same tokens
(greedy: the same argmax) — a faster engine with other answers would not be the same evaluation; the count of
differing answers is reported and the run fails above 1 % (float summation order can flip a near-tie).
Ratio (larger is better): paged_vs_contiguous_eval = contiguous seconds / paged seconds, median of the rounds
(target 1.2, issue 51).
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
ROOT = Path(__file__).resolve().parents[2]
TARGETS = {"paged_vs_contiguous_eval": 1.2}
SIZES = {"problems": (32, 200), "new_tokens": (16, 64), "rounds": (1, 2)}


def engines(args: Any, cfg: Any) -> dict:
    import torch

    from contiguous_engine import ContiguousEngine

    from areal_mq.engines.models import load_tokenizer, resolve_model
    from areal_mq.engines.torch.engine import TorchEngine
    from areal_mq.evaluation.heldout import EVAL_BATCH

    if args.threads:
        torch.set_num_threads(args.threads)
    model_dir = resolve_model(cfg.model.name, cfg.model.cache_dir)
    tok = load_tokenizer(model_dir)
    engine_cfg = cfg.rollout.engine.model_copy(update={"max_concurrent": EVAL_BATCH})
    attention = getattr(args, "attention", "auto")  # the paged engine's decode attention (engine.py --attention)
    return {"paged": TorchEngine(model_dir, engine_cfg.model_copy(update={"decode_attention": attention}),
                                 dtype=cfg.model.dtype, tokenizer=tok, device=args.device),
            "contiguous": ContiguousEngine(model_dir, engine_cfg, dtype=cfg.model.dtype, tokenizer=tok,
                                           device=args.device)}


def drive(engine: Any, prompts: list[list[int]], new_tokens: int, tag: str) -> tuple[float, dict]:
    from areal_mq.engines.base import EngineRequest
    from areal_mq.messages import SamplingSpec

    start = time.perf_counter()
    for i, ids in enumerate(prompts):
        engine.submit(EngineRequest(f"{tag}-{i}", ids, SamplingSpec(temperature=0.0, max_new_tokens=new_tokens)))
    outputs = {}
    while engine.has_work():
        for out in engine.step():
            outputs[out.request_id] = list(out.output_ids)
    seconds = time.perf_counter() - start
    assert len(outputs) == len(prompts), (len(outputs), len(prompts))
    return seconds, {int(k.rsplit("-", 1)[1]): v for k, v in outputs.items()}


def run(args: Any) -> dict:
    from areal_mq.config import load_config
    from areal_mq.data import load_eval_problems
    from areal_mq.data.prompts import ChatFormatter

    q = 0 if args.quick else 1
    cfg = load_config(ROOT / "configs" / "quickstart.yaml", [f"model.name={args.model}"])
    built = engines(args, cfg)
    fmt = ChatFormatter(built["paged"].tokenizer, cfg.data.system_prompt, cfg.data.examples)
    prompts = [fmt.ids(p) for p in load_eval_problems(cfg.data)[: SIZES["problems"][q]]]
    new_tokens = SIZES["new_tokens"][q]
    for name, engine in built.items():
        drive(engine, prompts[:4], 4, f"warm-{name}")
    seconds: dict[str, list[float]] = {name: [] for name in built}
    answers: dict[str, dict] = {}
    for r in range(SIZES["rounds"][q]):
        for name in (("paged", "contiguous") if r % 2 == 0 else ("contiguous", "paged")):
            s, answers[name] = drive(built[name], prompts, new_tokens, f"{name}-{r}")
            seconds[name].append(round(s, 2))
            log(f"eval round {r} {name:10s} {s:6.1f} s")
    for engine in built.values():
        engine.close()
    differ = sum(answers["paged"][i] != answers["contiguous"][i] for i in range(len(prompts)))
    if differ > max(1, len(prompts) // 100):
        raise SystemExit(f"the engines answered {differ} of {len(prompts)} problems differently (greedy)")
    paged, contiguous = statistics.median(seconds["paged"]), statistics.median(seconds["contiguous"])
    tokens = sum(len(v) for v in answers["paged"].values())
    import torch

    machine = common.torch_machine(threads=torch.get_num_threads(), model=cfg.model.name, dtype=cfg.model.dtype,
                                   device=common.device_name(args.device))
    return {"benchmark": "engine", "mode": "eval", "quick": args.quick, "machine": machine,
            "workload": {"problems": len(prompts), "new_tokens": new_tokens, "at_once": 128, "tokens": tokens,
                         "differing_answers": differ},
            "results": [{"engine": name, "seconds": s, "median_s": statistics.median(s),
                         "tokens_per_s": round(tokens / statistics.median(s), 1)} for name, s in seconds.items()],
            "ratios": {"paged_vs_contiguous_eval": round(contiguous / paged, 3)}, "targets": TARGETS}


def table(report: dict, command: str) -> str:
    w = report["workload"]
    rows = [("engine", "seconds (rounds)", "median s", "tokens/s")]
    rows += [(r["engine"], " ".join(map(str, r["seconds"])), f"{r['median_s']:.1f}", f"{r['tokens_per_s']:.1f}")
             for r in report["results"]]
    lines = common.align(rows, rule=False) + [""] + common.align(common.ratio_rows(report), rule=False)
    lines.append(f"workload: the quickstart's held-out evaluation, {w['problems']} problems, greedy, <= "
                 f"{w['new_tokens']} new tokens, {w['at_once']} at once; {w['tokens']} tokens; differing answers "
                 f"{w['differing_answers']}")
    return "\n".join(lines + [f"reproduce: {command}"])
