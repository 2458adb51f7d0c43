"""`areal-mq reward ...`: attach a reward server to a running broker, or score one completion by hand.

    areal-mq reward serve my_pkg.rewards:score --broker tcp://10.0.0.2:5555 [--task math] [--processes 4]
    areal-mq reward score arith '\\boxed{4}' --reference 4 [--truncated]

The lead's areal_mq/cli.py mounts `app` as `areal-mq reward`. Heavy modules load inside the commands so
`areal-mq --help` stays fast.
"""
from __future__ import annotations

import json
from typing import List, Optional

import typer

app = typer.Typer(no_args_is_help=True, help="Reward servers and reward functions.")


@app.command("serve")
def serve_cmd(
    fn: str = typer.Argument(..., help="Import path 'pkg.module:function', 'file.py:function' or a built-in name "
                                       "(arith, math, format, code, math_concise)."),
    broker: Optional[str] = typer.Option(None, "--broker", "-b", help="Job broker, tcp://HOST:PORT; the signal bus "
                                         "is then HOST:PORT+1 / PORT+2 unless the config or --set names its ports "
                                         "(default: brokers.* of the config)."),
    config: Optional[str] = typer.Option(None, "--config", "-c", help="YAML run config for the other settings."),
    set_: Optional[List[str]] = typer.Option(None, "--set", "-s", help="Override a config field: section.key=value."),
    task: str = typer.Option("*", help="Task name this function scores ('*' = every task)."),
    service: str = typer.Option("reward", help="Broker service to serve."),
    processes: Optional[int] = typer.Option(None, min=1, help="Pool processes (= capacity); default reward.processes."),
    timeout: Optional[float] = typer.Option(None, min=0.001, help="Deadline of one call, seconds."),
    worker_id: Optional[str] = typer.Option(None, help="Stable id (default: reward-host-pid)."),
) -> None:
    """Serve FN for reward jobs from a running broker until SIGTERM or a shutdown signal."""
    from areal_mq.errors import ConfigError

    from areal_mq.workers.reward import build_config, describe_addresses, serve

    try:
        cfg = build_config(config, broker, set_)
        typer.echo(f"reward serve: {describe_addresses(cfg)}", err=True)
        code = serve(fn, config=cfg, task=task, service=service, processes=processes, timeout_s=timeout,
                     worker_id=worker_id)
    except ConfigError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2)
    raise typer.Exit(code)


@app.command("score")
def score_cmd(
    fn: str = typer.Argument(..., help="Built-in name or import path of a per-sample or group reward function."),
    completions: List[str] = typer.Argument(..., help="Completion text(s); several make a group."),
    reference: Optional[str] = typer.Option(None, "--reference", "-r", help="Reference answer (JSON or text)."),
    prompt: str = typer.Option("", help="Prompt text."),
    truncated: bool = typer.Option(False, help="Mark the completions as truncated at the length cap."),
    kwarg: Optional[List[str]] = typer.Option(None, "--kwarg", "-k", help="Function argument key=JSON (repeatable)."),
) -> None:
    """Score completions in this process and print one JSON line each (for checking a reward function)."""
    from areal_mq.errors import ConfigError

    from areal_mq.rewards.registry import RewardRegistry

    try:
        rfn = RewardRegistry().resolve(fn)
    except ConfigError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2)
    ref = _json_or_text(reference) if reference is not None else None
    meta = {"truncated": [truncated] * len(completions) if rfn.group else truncated}
    for item in kwarg or []:
        key, sep, raw = item.partition("=")
        if not sep:
            typer.echo(f"error: --kwarg {item!r} must look like key=value", err=True)
            raise typer.Exit(2)
        meta[key] = _json_or_text(raw)
    if rfn.group:
        scored = rfn(prompt, list(completions), ref, meta)
    else:
        scored = [rfn(prompt, c, ref, meta)[0] for c in completions]
    for text, (reward, details) in zip(completions, scored):
        typer.echo(json.dumps({"reward": reward, "details": details, "completion": text[:80]}))


def _json_or_text(raw: str):
    try:
        return json.loads(raw)
    except ValueError:
        return raw
