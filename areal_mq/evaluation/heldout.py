"""Held-out evaluation: answers of a policy version on the test split, graded strict and lenient.

strict  = exactly one \\boxed{N} (the form the prompt asks for) and N equals the reference;
lenient = the last boxed number, else the last number in the text, equals the reference (tells arithmetic
from format learning). Both are areal_mq.grading's verdicts, the ones the rewards pay for.
The policy is the base model, or a published weights directory (run_dir/weights/vN), or a checkpoint —
always a named version, never weights that change during the evaluation.

    areal-mq eval --config configs/quickstart.yaml [--weights runs/quickstart/weights/v20] [--n 200]

By default one greedy answer per problem. With eval.samples N > 1 (`--samples N --temperature T --k 1,4,8`) each
problem gets N sampled answers (request ids PROBLEM#sJ, seeded per request by the engine's seed), `strict` and
`lenient` are the mean over all answers, and `pass_at_k` holds pass@k, maj@k and the means, overall and per level
(evaluation/passk.py).
"""
from __future__ import annotations

import json
import os
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from areal_mq.errors import ConfigError


EVAL_BATCH = 128  # requests decoded together in a held-out evaluation
NO_EVAL_SET = ("data.eval_name is not set and data.name {name!r} has no built-in held-out split: set data.eval_name to a "
               "test split (a .jsonl/.parquet file or DIR:test), or run with --skip-eval")


def check_eval_set(cfg: Any) -> None:
    """ConfigError (one line, before any process or model load) when a run that evaluates has no held-out set."""
    if not cfg.data.has_eval_set():
        raise ConfigError(NO_EVAL_SET.format(name=cfg.data.name))


def eval_setup(cfg: Any, n: int | None) -> tuple:
    """(problems, tokenizer, formatter, engine) for a held-out evaluation of `n` problems (default eval.size).

    Greedy outputs do not depend on the batch (per-request streams), so the engine runs wide batches: 128 at
    once scores the same as 32 and is ~1.5x faster on a 2-core CPU (0.30 s against 0.44 s a problem)."""
    from areal_mq.data.prompts import ChatFormatter
    from areal_mq.devices import role_device
    from areal_mq.engines import build_engine
    from areal_mq.engines.models import load_tokenizer, resolve_model

    problems = eval_problems(cfg, n)
    tokenizer = load_tokenizer(resolve_model(cfg.model.name, cfg.model.cache_dir))
    fmt = ChatFormatter(tokenizer, cfg.data.system_prompt, cfg.data.examples)
    engine_cfg = cfg.rollout.engine.model_copy(update={"max_concurrent": max(cfg.rollout.engine.max_concurrent, EVAL_BATCH),
                                                       **({"kv_cache_bytes": cfg.eval.kv_cache_bytes}
                                                          if cfg.eval.kv_cache_bytes else {})})
    # a held-out evaluation is generation: it runs where the rollout engine runs (rollout.device, else model.device)
    return problems, tokenizer, fmt, build_engine(engine_cfg, cfg.model, seed=cfg.run.seed,
                                                  device=role_device(cfg, "rollout"))


def eval_problems(cfg: Any, n: int | None = None) -> list:
    """The held-out problems of an evaluation: the first `n` (default eval.size) of the held-out set."""
    from areal_mq.data import load_eval_problems

    problems = load_eval_problems(cfg.data)[: n or cfg.eval.size]
    if not problems:
        raise ConfigError(NO_EVAL_SET.format(name=cfg.data.name))
    return problems


def eval_params(cfg: Any, max_new_tokens: int | None = None, samples: int | None = None,
                temperature: float | None = None, top_p: float | None = None, ks: list[int] | None = None) -> tuple:
    """(samples, sampling, ks) of an evaluation: eval.samples, eval.temperature / top_p with controller.max_new_tokens,
    eval.k, unless given. The one definition for the standalone evaluation and the one through the rollout engines
    (eval.via rollout, workers/controller_eval.py)."""
    from areal_mq.evaluation.passk import check_ks
    from areal_mq.messages import SamplingSpec

    e = cfg.eval
    samples = e.samples if samples is None else samples
    temperature = e.temperature if temperature is None else temperature
    ks = check_ks(list(e.k if ks is None else ks), samples, temperature)
    sampling = SamplingSpec(temperature=temperature, top_p=e.top_p if top_p is None else top_p,
                            max_new_tokens=max_new_tokens or cfg.controller.max_new_tokens)
    return samples, sampling, ks


def request_ids(problem: Any, samples: int) -> list[str]:
    """The request id of each answer to `problem`: its id (one answer), else PROBLEM#sJ (what `score` reads)."""
    return [problem.id] if samples == 1 else [f"{problem.id}#s{j}" for j in range(samples)]


def score(outputs: list, problems: list, samples: int, ks: list[int]) -> dict:
    """The graded result of `outputs` (request_id, text, finish_reason) on `problems`: `summarize` for one answer a
    problem, `summarize_sampled` for several."""
    return summarize(outputs, problems) if samples == 1 else summarize_sampled(outputs, problems, samples, ks)


def generate_answers(cfg: Any, weights: str | None, version: int | None, n: int | None, samples: int, sampling: Any,
                     progress: bool = True) -> tuple[list, list, float]:
    """(engine outputs, problems, seconds): a standalone engine's answers of `weights` (None: the base model) on the
    held-out problems, `samples` each; seconds from the built engine on (the weights' load and the answers)."""
    from areal_mq.devices import release_device_memory
    from areal_mq.engines.base import EngineRequest

    problems, tokenizer, fmt, engine = eval_setup(cfg, n)
    t0 = time.perf_counter()
    try:
        if weights:
            from areal_mq.weights.disk import load_version_dir  # a full or a LoRA version

            load_version_dir(engine, version if version is not None else 1, weights)
        for p in problems:
            ids = fmt.ids(p)
            for rid in request_ids(p, samples):
                engine.submit(EngineRequest(rid, ids, sampling))
        outputs = _drain(engine, len(problems) * samples, progress)
        return outputs, problems, time.perf_counter() - t0
    finally:
        engine.close()
        del engine  # the launcher evaluates in its own process: its model and KV pool must not outlive this
        release_device_memory()


def evaluate(cfg: Any, weights: str | None = None, n: int | None = None, version: int | None = None,
             progress: bool = True, max_new_tokens: int | None = None, samples: int | None = None,
             temperature: float | None = None, top_p: float | None = None, ks: list[int] | None = None) -> dict:
    """samples / temperature / top_p / ks: default eval.samples, eval.temperature, eval.top_p, eval.k."""
    samples, sampling, ks = eval_params(cfg, max_new_tokens, samples, temperature, top_p, ks)
    outputs, problems, seconds = generate_answers(cfg, weights, version, n, samples, sampling, progress)
    return {**score(outputs, problems, samples, ks), "weights": weights or "base",
            "version": version if version is not None else 0, "samples": samples,
            "temperature": sampling.temperature, "seconds": round(seconds, 1)}


def summarize_sampled(outputs: list, problems: list, samples: int, ks: list[int]) -> dict:
    """N answers per problem: `summarize` over every answer (strict / lenient are then the means) plus pass@k and
    maj@k (evaluation/passk.py) under "pass_at_k"."""
    import dataclasses

    from areal_mq.evaluation.passk import summarize_samples
    from areal_mq.grading import grade

    by_id = {p.id: p for p in problems}
    per_sample = [dataclasses.replace(p, id=f"{p.id}#s{j}") for p in problems for j in range(samples)]
    result = summarize(outputs, per_sample)
    graded: dict[str, list] = {p.id: [None] * samples for p in problems}
    for out in outputs:
        pid, _, j = out.request_id.rpartition("#s")
        graded[pid][int(j)] = grade(out.text, by_id[pid].answer)
    graded = {pid: [g for g in gs if g is not None] for pid, gs in graded.items() if any(g is not None for g in gs)}
    result["pass_at_k"] = summarize_samples(graded, {pid: _groups(by_id[pid]) for pid in graded}, ks)
    result["problems"] = len(graded)
    return result


def summarize(outputs: list, problems: list) -> dict:
    """Accuracy of `outputs` (engine outputs: request_id, text, finish_reason) on `problems`, overall and per group.

    n / strict / lenient / truncated over all; by_level ("L5") for problems with a level, by_subject for those
    with meta["subject"] (MATH), by_source when the problems come from several sources (meta["source"]). A
    problem without a level, subject or source counts in "all" only."""
    from areal_mq.grading import grade

    by_id = {p.id: p for p in problems}
    totals: dict = defaultdict(lambda: [0, 0, 0])  # (group, key) -> [n, strict, lenient]
    for out in outputs:
        p = by_id[out.request_id]
        verdict = grade(out.text, p.answer)
        for group in _groups(p):
            totals[group][0] += 1
            totals[group][1] += int(verdict.strict)
            totals[group][2] += int(verdict.lenient)
    n_all, strict, lenient = totals[("all", "all")]
    n_all = n_all or 1  # no outputs: rates of 0, not a ZeroDivisionError
    result = {"n": totals[("all", "all")][0], "strict": strict / n_all, "lenient": lenient / n_all,
              "truncated": sum(o.finish_reason == "length" for o in outputs) / n_all,
              "by_level": _table(totals, "by_level")}
    if any(group == "by_subject" for group, _ in totals):
        result["by_subject"] = _table(totals, "by_subject")
    if sum(group == "by_source" for group, _ in totals) > 1:
        result["by_source"] = _table(totals, "by_source")
    return result


def _groups(p: Any) -> list[tuple[str, str]]:
    groups = [("all", "all")]
    if p.level is not None:
        groups.append(("by_level", f"L{p.level}"))
    for group, field in (("by_subject", "subject"), ("by_source", "source")):
        if p.meta.get(field) is not None:
            groups.append((group, str(p.meta[field])))
    return groups


def _table(totals: dict, group: str) -> dict:
    return {key: {"n": v[0], "strict": v[1] / v[0], "lenient": v[2] / v[0]}
            for (g, key), v in sorted(totals.items()) if g == group}


def base_eval_cached(cfg: Any, progress: bool = True) -> dict:
    """The base model's result, cached per (model, held-out set, size, length cap, prompt): the base model
    never changes, so a second run does not spend minutes of its budget measuring it again."""
    import hashlib

    from areal_mq.engines.models import models_cache_dir

    # the training order (data.seed, shuffle, epochs) does not change what the base model answers
    data = cfg.data.model_dump(exclude={"seed", "shuffle", "epochs"})
    key = json.dumps([cfg.model.model_dump(), data, cfg.eval.model_dump(exclude={"every", "via"}),
                      cfg.controller.max_new_tokens, cfg.rollout.engine.kind] + ([cfg.rollout.engine.dtype] if cfg.rollout.engine.dtype != "auto" else []),
                     sort_keys=True, default=str)
    path = models_cache_dir(cfg.model.cache_dir).parent / "eval" / f"{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"
    if path.exists():
        return {**json.loads(path.read_text()), "cached": True}
    result = evaluate(cfg, progress=progress)
    path.parent.mkdir(parents=True, exist_ok=True)
    # runs side by side share the cache (benchmarks/gpu/stage_q_quality.py): a reader must never see half a file
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(result))
    os.replace(tmp, path)
    return result


def _drain(engine: Any, total: int, progress: bool) -> list:
    from tqdm import tqdm

    outputs = []
    with tqdm(total=total, desc="eval", unit="problem", disable=not progress, leave=False) as bar:
        while engine.has_work():
            done = engine.step()
            outputs.extend(done)
            bar.update(len(done))
    return outputs


def append_result(run_dir: str | Path, result: dict) -> None:
    path = Path(run_dir) / "eval.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps({"time": time.time(), **result}) + "\n")
