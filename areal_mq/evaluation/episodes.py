"""Held-out evaluation of a workflow: accuracy at the first attempt, within all attempts, tool use.

What: runs the workflow on `n` held-out problems with an in-process engine (local.py), greedy by default, all
episodes at once (the engine batches their turns), on the base model or a published weights directory:

    acc_first     correct at the first model turn (ctx.info correct_at == 1)
    acc_within    correct at any attempt (correct_at >= 1)
    tool_frac     episodes that called the tool (tool_calc, openai_agent: ctx.info tool_calls > 0), with
                  acc_with_tool / acc_without_tool over those two subsets
    tool_error_frac  episodes with ctx.info tool_errors > 0 (tool_calc: an expression the calculator refused;
                  openai_agent: a reply that opened a tool call that was not a valid one)
    tool_repair_frac  episodes with ctx.info tool_repairs > 0 (openai_agent with tool_family prompted_bare: a call
                  read as a bare argument)
Run: python -m areal_mq.evaluation.episodes --config configs/multiturn.yaml [--weights runs/multiturn/weights/v36]
        [--workflow tool_calc] [--n 200] [--out result.json]
     python -m areal_mq.evaluation.episodes --config configs/tools-arith.yaml --workflow openai_agent --n 100 \
        [--set agent.workflow_args.agent=areal_mq.workflows.calculator_agent:solve_no_tools]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import time
from typing import Any

EVAL_TIMEOUT_S = 24 * 3600.0


async def _episodes(cfg: Any, workflow: Any, problems: list, tokenizer: Any, fmt: Any, backend: Any,
                    sampling: Any, progress: bool) -> list:
    from tqdm import tqdm

    from areal_mq.data.loaders import Problem
    from areal_mq.workflows.context import EpisodeContext
    from areal_mq.workflows.runner import run_episode

    bar = tqdm(total=len(problems), desc="episodes", unit="ep", disable=not progress, leave=False)

    async def one(p: Any) -> tuple:
        ctx = EpisodeContext(Problem(p.id, p.prompt, str(p.answer), p.level or 0), fmt.ids(p), tokenizer, backend,
                             sampling=sampling, episode_id=f"eval-{p.id}", max_turns=cfg.agent.max_turns,
                             max_tokens=cfg.agent.max_episode_tokens, args=cfg.agent.workflow_args,
                             reward_task=cfg.controller.reward_task)
        # no episode timeout: all episodes are queued at once, so a late one waits for the engine, not hangs
        outcome = await run_episode(workflow, ctx, ctx.problem, EVAL_TIMEOUT_S)
        bar.update(1)
        return outcome, ctx.info

    try:
        return await asyncio.gather(*(one(p) for p in problems))
    finally:
        bar.close()


def evaluate_workflow(cfg: Any, workflow: str | None = None, weights: str | None = None, n: int | None = None,
                      temperature: float = 0.0, progress: bool = True) -> dict:
    from areal_mq.evaluation.heldout import eval_setup
    from areal_mq.messages import SamplingSpec
    from areal_mq.workflows.local import EngineBackend, LocalRewards
    from areal_mq.workflows.runner import load_workflow

    spec = workflow or cfg.agent.workflow or "single"
    fn = load_workflow(spec)
    problems, tokenizer, fmt, engine = eval_setup(cfg, n)
    t0 = time.perf_counter()
    try:
        if weights:
            from areal_mq.weights.disk import load_version_dir  # a full or a LoRA version

            load_version_dir(engine, 1, weights)
        sampling = SamplingSpec(temperature=temperature, max_new_tokens=cfg.controller.max_new_tokens, seed=cfg.run.seed)
        backend = EngineBackend(engine, rewards=LocalRewards(cfg.reward))  # controller.reward_task, in process
        results = asyncio.run(_episodes(cfg, fn, problems, tokenizer, fmt, backend, sampling, progress))
    finally:
        engine.close()
    return {**summarize(results, spec, weights, time.perf_counter() - t0),
            "workflow_args": dict(cfg.agent.workflow_args)}  # e.g. openai_agent's agent: which arm this is


def summarize(results: list, spec: str, weights: str | None, seconds: float) -> dict:
    n = len(results)
    infos = [info for _, info in results]
    tool = [i for i in infos if i.get("tool_calls", 0) > 0]
    no_tool = [i for i in infos if i.get("tool_calls", 0) == 0]

    def acc(rows: list) -> float | None:
        return round(sum(i.get("correct_at", 0) >= 1 for i in rows) / len(rows), 4) if rows else None

    return {"workflow": spec, "weights": weights or "base", "n": n,
            "acc_first": round(sum(i.get("correct_at", 0) == 1 for i in infos) / n, 4), "acc_within": acc(infos),
            "failed": sum(o.error is not None for o, _ in results),
            "errors": sorted({o.error[:160] for o, _ in results if o.error is not None})[:5],  # why, a few kinds
            "turns_mean": round(sum(o.turns for o, _ in results) / n, 3),
            "tool_frac": round(len(tool) / n, 4), "acc_with_tool": acc(tool), "acc_without_tool": acc(no_tool),
            "tool_error_frac": round(sum(i.get("tool_errors", 0) > 0 for i in infos) / n, 4),
            "tool_repair_frac": round(sum(i.get("tool_repairs", 0) > 0 for i in infos) / n, 4),
            "seconds": round(seconds, 1)}


def main(argv: list[str] | None = None) -> int:
    from areal_mq.config import load_config

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", required=True)
    ap.add_argument("--workflow", default=None, help="built-in or module:function (default: agent.workflow)")
    ap.add_argument("--weights", default=None, help="a published weights directory (default: the base model)")
    ap.add_argument("--n", type=int, default=None)
    ap.add_argument("--out", default=None, help="append the result as one JSON line to this file")
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    args = ap.parse_args(argv)
    result = evaluate_workflow(load_config(args.config, args.overrides), args.workflow, args.weights, args.n)
    print(json.dumps(result))
    if args.out:
        with open(args.out, "a") as f:
            f.write(json.dumps(result) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
