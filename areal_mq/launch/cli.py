"""CLI commands `run`, `eval` and `plot` (mounted on the main `areal-mq` app by areal_mq.cli).

    areal-mq run configs/quickstart.yaml [--set a.b=v] [--resume RUN_DIR]
    areal-mq run configs/quickstart.yaml --backend ray [--address HOST:PORT]   # roles as Ray actors
    areal-mq run configs/qwen2.5-7b-2nodes.yaml --rehearse [--steps 4]          # the layout at toy scale, here
    areal-mq eval --config configs/quickstart.yaml [--weights RUN_DIR/weights/vN] [--n 200]
    areal-mq plot RUN_DIR
"""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import List, Optional

import typer

# the --set help of every command (areal_mq/cli.py imports it from here: this module is light)
SET_HELP = ("Override a config field: section.key=value (repeatable; values are YAML). A key inside a dict "
            "field merges into it (--set reward.tasks.mine.fn=pkg:f adds a task, the others stay); setting the "
            "dict itself (--set 'reward.tasks={mine: {fn: pkg:f}}') replaces it. `config show` prints the result.")


def register(app: typer.Typer) -> None:
    app.command("run")(run)
    app.command("eval")(eval_cmd)
    app.command("plot")(plot_cmd)


def _cfg(path: Optional[str], overrides: Optional[List[str]], resume: Optional[str] = None):
    from areal_mq.config import load_config
    from areal_mq.errors import ConfigError

    try:
        if resume:
            saved = Path(resume) / "config.yaml"
            if not saved.exists():
                raise ConfigError(f"--resume {resume}: no config.yaml there (is it a run directory?)")
            return load_config(saved, overrides or [])
        return load_config(path, overrides or [])
    except ConfigError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2)


def run(config: Optional[str] = typer.Argument(None, help="YAML run config (e.g. configs/quickstart.yaml)."),
        set_: Optional[List[str]] = typer.Option(None, "--set", "-s", help=SET_HELP),
        resume: Optional[str] = typer.Option(None, help="Continue the run in this run directory."),
        skip_eval: bool = typer.Option(False, "--skip-eval", help="No held-out evaluation before/after."),
        quiet: bool = typer.Option(False, help="No live display (logs only)."),
        insecure: bool = typer.Option(False, "--insecure", help="No CURVE keys: plaintext, unauthenticated sockets "
                                      "(debugging only; loopback only)."),
        backend: Optional[str] = typer.Option(None, "--backend", help="local (default): every process on this host; "
                                              "ray: each role a Ray actor (launcher.backend; docs/many-hosts.md)."),
        address: Optional[str] = typer.Option(None, "--address", help="Ray cluster to join, HOST:PORT of its head "
                                              "(launcher.ray_address; default $RAY_ADDRESS or a new local Ray)."),
        rehearse: bool = typer.Option(False, "--rehearse", help="Rehearse this layout at toy scale on this machine "
                                      "before paying for GPUs: a small random model of the same family, every process "
                                      "the config asks for (GPU indices become pretend devices), the full-scale plan, "
                                      "a few steps, one trainer rank killed and resumed; writes RUN_DIR/rehearsal.json "
                                      "and exits 1 naming the role and the config field on any failure "
                                      "(areal_mq/launch/rehearsal.py, docs/gpu-layouts.md)."),
        steps: int = typer.Option(4, "--steps", min=2, max=100, help="--rehearse: training steps (versions) to run."),
        no_kill: bool = typer.Option(False, "--no-kill", help="--rehearse: run the steps once, without killing and "
                                     "resuming a trainer rank (the restart path is then not checked)."),
        device_gib: Optional[float] = typer.Option(None, "--device-gib", help="--rehearse: one GPU's memory for the "
                                                   "full-scale plan (default: this machine's GPU, else 80).")) -> None:
    """Run the whole system: brokers, controller, rollout, reward and trainer processes (this host, or Ray)."""
    if not config and not resume:
        typer.echo("error: give a CONFIG or --resume RUN_DIR", err=True)
        raise typer.Exit(2)
    from rich.console import Console

    overrides = [*(set_ or []), *(["security.insecure=true"] if insecure else []),
                 *([f"launcher.backend={backend}"] if backend else [])]
    cfg = _cfg(config, overrides, resume)
    if address:
        cfg.launcher.ray_address = address  # as given (a YAML override could read HOST:PORT as a number)
    console = Console(stderr=True, soft_wrap=True)
    if no_kill and not rehearse:
        typer.echo("error: --no-kill is an option of --rehearse", err=True)
        raise typer.Exit(2)
    if rehearse:
        from areal_mq.errors import ConfigError
        from areal_mq.launch.rehearsal import rehearse as rehearse_layout

        try:
            report = rehearse_layout(cfg, console, steps=steps, device_gib=device_gib, quiet=quiet,
                                     kill=not no_kill)
        except ConfigError as exc:
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(2)
        raise typer.Exit(0 if report["ok"] else 1)
    if not skip_eval and not resume:
        _check_eval_set(cfg)
    from areal_mq.errors import ArealError
    from areal_mq.launch.job import check_memory, execute

    check_memory(cfg)
    try:
        outcome, _ = execute(cfg, console, skip_eval=skip_eval, quiet=quiet, resume=bool(resume))
    except ArealError as exc:  # what a user can cause before the run starts (a missing file, model, key): one line
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2)
    if outcome == "failed":
        raise typer.Exit(1)
    if outcome == "interrupted":
        raise typer.Exit(130)


def _check_eval_set(cfg) -> None:
    from areal_mq.errors import ConfigError
    from areal_mq.evaluation.heldout import check_eval_set

    try:
        check_eval_set(cfg)
    except ConfigError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2)


def eval_cmd(config: Optional[str] = typer.Option(None, "--config", "-c", help="YAML run config."),
             set_: Optional[List[str]] = typer.Option(None, "--set", "-s", help=SET_HELP),
             weights: Optional[str] = typer.Option(None, help="Published weights dir or checkpoint (default: base)."),
             n: Optional[int] = typer.Option(None, help="Number of held-out problems."),
             version: Optional[int] = typer.Option(None, help="Policy version these weights are (recorded)."),
             append_to: Optional[str] = typer.Option(None, help="Append the result to RUN_DIR/eval.jsonl."),
             no_progress: bool = typer.Option(False, "--no-progress", help="No progress bar."),
             as_json: bool = typer.Option(False, "--json", help="Print the result as JSON."),
             samples: Optional[int] = typer.Option(None, help="Answers per problem (default eval.samples, 1); N > 1 "
                                                   "reports pass@k and maj@k (needs --temperature > 0)."),
             temperature: Optional[float] = typer.Option(None, help="Sampling temperature (default eval.temperature, "
                                                         "0: greedy)."),
             top_p: Optional[float] = typer.Option(None, "--top-p", help="Nucleus sampling (default eval.top_p)."),
             k: Optional[str] = typer.Option(None, help="The k of pass@k / maj@k, comma-separated, e.g. 1,4,8 "
                                             "(default eval.k).")) -> None:
    """Accuracy (strict and lenient) of the base model or a checkpoint on the held-out split; with --samples N,
    mean accuracy over N answers a problem, pass@k and maj@k (areal_mq/evaluation/passk.py)."""
    from areal_mq.errors import ConfigError
    from areal_mq.evaluation.heldout import append_result, evaluate

    overrides = list(set_ or [])
    try:
        ks = [int(x) for x in k.split(",") if x.strip()] if k is not None else None
    except ValueError:
        typer.echo(f"error: --k {k!r}: give whole numbers separated by commas, e.g. 1,4,8", err=True)
        raise typer.Exit(2)
    for name, value in (("samples", samples), ("temperature", temperature), ("top_p", top_p)):
        if value is not None:
            overrides.append(f"eval.{name}={value}")
    if ks is not None:
        overrides.append(f"eval.k={json.dumps(ks)}")
    cfg = _cfg(config, overrides)
    if weights and not Path(weights).is_dir():
        typer.echo(f"error: --weights {weights} is not a directory", err=True)
        raise typer.Exit(2)
    if append_to and not Path(append_to).is_dir():
        typer.echo(f"error: --append-to {append_to} is not a run directory", err=True)
        raise typer.Exit(2)
    t0 = time.time()
    try:
        result = evaluate(cfg, weights=weights, n=n, version=version, progress=not no_progress)
    except ConfigError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2)
    if append_to:
        append_result(append_to, result)
    if as_json:
        typer.echo(json.dumps(result))
        return
    typer.echo(f"{result['weights']}: strict {result['strict']:.1%}  lenient {result['lenient']:.1%}  "
               f"truncated {result['truncated']:.1%}  n={result['n']}  ({time.time() - t0:.0f}s)")
    for level, r in result["by_level"].items():
        typer.echo(f"  {level}: strict {r['strict']:.1%} lenient {r['lenient']:.1%} (n={r['n']})")
    pk = result.get("pass_at_k")
    if pk:
        typer.echo(f"  {result['samples']} answers a problem at temperature {result['temperature']:g} "
                   f"({pk['n']} problems): mean strict {pk['mean_strict']:.1%} lenient {pk['mean_lenient']:.1%}")
        for kk in pk["k"]:
            typer.echo(f"  pass@{kk}: strict {pk['pass@k_strict'][str(kk)]:.1%} lenient "
                       f"{pk['pass@k_lenient'][str(kk)]:.1%}   maj@{kk}: strict {pk['maj@k_strict'][str(kk)]:.1%} "
                       f"lenient {pk['maj@k_lenient'][str(kk)]:.1%}")


def plot_cmd(run_dir: str = typer.Argument(..., help="Run directory."),
             out: Optional[str] = typer.Option(None, help="PNG path (default RUN_DIR/plots/training.png).")) -> None:
    """Draw reward, held-out accuracy, staleness and throughput against time."""
    from areal_mq.telemetry.plots import plot_run

    try:
        typer.echo(str(plot_run(run_dir, out)))
    except FileNotFoundError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2)
