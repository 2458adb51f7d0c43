"""Load the operator's workflow and run one episode of it, never letting a bad episode take the agent down.

What: `load_workflow(spec)` -> the async function for a built-in name or a 'module:function' the operator named
on the CLI or in the config (ConfigError with what was wrong otherwise; nothing from the wire is ever a spec).
`run_episode(workflow, ctx, problem, timeout_s)` -> EpisodeOutcome: the SeqSample of the episode, or the reason
it failed (the workflow raised, timed out, returned no finite reward, or generated nothing). Failures are data,
not exceptions: the agent answers the job with an Error and takes the next one.
"""
from __future__ import annotations

import asyncio
import inspect
import math
import time
from dataclasses import dataclass
from typing import Any, Callable

from areal_mq.errors import ConfigError
from areal_mq.messages import SeqSample
from areal_mq.workflows.builtin import BUILTINS
from areal_mq.workflows.specs import import_function


def load_workflow(spec: str) -> Callable:
    """A built-in name or 'package.module:function' naming an `async def f(ctx, problem)`."""
    if spec in BUILTINS:
        return BUILTINS[spec]
    fn = import_function(spec, f"workflow {spec!r}", f"a built-in ({', '.join(BUILTINS)}) or 'module:function', "
                         "e.g. my_pkg.workflows:episode")
    if not inspect.iscoroutinefunction(fn):
        name = spec.partition(":")[2]
        raise ConfigError(f"workflow {spec!r} must be an async function `async def {name}(ctx, problem)`")
    return fn


@dataclass
class EpisodeOutcome:
    seq: SeqSample | None
    turns: int
    seconds: float
    error: str | None = None  # why the episode failed (seq is None then)


async def run_episode(workflow: Callable, ctx: Any, problem: Any, timeout_s: float) -> EpisodeOutcome:
    t0 = time.monotonic()

    def failed(why: str) -> EpisodeOutcome:
        turns = ctx.episode.turns if ctx.episode is not None else 0
        return EpisodeOutcome(None, turns, time.monotonic() - t0, why)

    try:
        reward = await asyncio.wait_for(workflow(ctx, problem), timeout_s)
    except asyncio.TimeoutError:
        return failed(f"timeout: the episode ran longer than agent.episode_timeout_s ({timeout_s:g} s)")
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # the workflow's bug or a failed turn: this episode only
        return failed(f"{type(exc).__name__}: {str(exc)[:500]}")
    if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
        return failed(f"the workflow returned {type(reward).__name__} {str(reward)[:50]}, not a finite reward")
    if ctx.episode is None or ctx.episode.turns == 0:
        return failed("the workflow generated nothing (no ctx.generate call)")
    info = {k: v for k, v in ctx.info.items() if isinstance(v, (int, float, str, bool))}
    try:
        seq = ctx.episode.to_seq(float(reward), ctx.finish_reason, info)
    except ValueError as exc:
        return failed(f"bad episode trace: {exc}")
    return EpisodeOutcome(seq, ctx.episode.turns, time.monotonic() - t0)
