"""One run of a config on this host or under Ray: what `areal-mq run` and a rehearsal (rehearsal.py) both execute.

What: `execute(cfg, console, skip_eval=, quiet=, resume=)` starts the launcher (local or Ray), evaluates the base
model, starts every process, supervises them with live progress, runs the periodic and final evaluations and draws
the plot; `check_memory(cfg)` is `areal-mq plan`'s refusal before anything starts. Errors a user can cause before
the run starts leave as `typer.Exit(2)` with one line (a taken port, a bad layout) or as an ArealError the caller
prints.
Why a module of its own: the CLI (launch/cli.py) and the rehearsal (launch/rehearsal.py) run the same body, and
neither imports the other.
"""
from __future__ import annotations

from pathlib import Path

import typer


def check_memory(cfg) -> None:
    """`areal-mq plan`'s check before anything starts: a layout that cannot fit stops here (exit 2) with the
    numbers and the knob, not after the model load. Skipped where the model's config cannot be read (a
    simulated engine and trainer, a model not yet converted: the run itself says what is missing)."""
    from areal_mq.launch.plan import make_plan

    if cfg.launcher.backend != "local" or (cfg.trainer.sim.enabled and cfg.rollout.engine.kind == "sim"):
        return
    try:
        result = make_plan(cfg)
    except Exception:  # noqa: BLE001 - the estimate is advice; the run reports real errors itself
        return
    if result.refusals:
        typer.echo(result.table(), err=True)
        typer.echo("error: this layout does not fit (areal-mq plan CONFIG shows the same table)", err=True)
        raise typer.Exit(2)


def execute(cfg, console, *, skip_eval: bool, quiet: bool, resume: bool) -> tuple[str, object]:
    """Start, supervise and stop one run of `cfg` (the body of `areal-mq run`, also what a rehearsal runs):
    the base evaluation, every process, the periodic and final evaluations, the plot. Returns (outcome, launcher): outcome
    'done', 'failed' (launcher.failure says why) or 'interrupted'."""
    from areal_mq.errors import ConfigError
    from areal_mq.launch.launcher import Launcher

    if skip_eval and cfg.eval.via == "rollout":  # the controller evaluates, reading the config the launcher writes
        cfg.eval.every = 0
    if cfg.launcher.backend == "ray":  # ports are settled on the brokers' node
        from areal_mq.launch.ray_backend import RayLauncher

        launcher = RayLauncher(cfg, console)
    else:
        launcher = Launcher(claim_ports(cfg, console), console)
    try:
        path = launcher.prepare()
    except ConfigError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2)
    console.print(f"[bold]areal-mq run[/] {cfg.run.name}: mode={cfg.run.mode} η={cfg.controller.max_staleness} "
                  f"model={cfg.model.name} steps={cfg.controller.total_steps} → {cfg.run.run_dir}")
    if not skip_eval and not resume:
        _eval_into_run(cfg, None, 0, console, "base model")
    launcher.plan(path)
    if cfg.eval.every and not skip_eval:
        from areal_mq.evaluation.periodic import PeriodicEval, RolloutEvalNotes

        # via rollout the controller evaluates through the rollout engines; the launcher only reports its results
        launcher.evaluator = (PeriodicEval.from_config(cfg, path) if cfg.eval.via == "process"
                              else RolloutEvalNotes(Path(cfg.run.run_dir)))
    _stop_signals_interrupt()
    outcome = "failed"
    try:
        launcher.start_all()
        from areal_mq.launch.progress import live_progress

        outcome = live_progress(launcher, console, quiet=quiet)
    except KeyboardInterrupt:
        console.print("[yellow]Ctrl-C: asking the trainer to checkpoint, then stopping…[/]")
        launcher.request_checkpoint_and_stop("ctrl-c")
        outcome = "interrupted"
    finally:
        launcher.stop_all()
        if launcher.evaluator is not None:  # a periodic evaluation still running is a result worth its minutes
            launcher.evaluator.wait(timeout_s=600 if outcome == "done" else 0)
    if outcome == "failed":
        console.print(f"[red]run stopped: {launcher.failure}[/]")
        return outcome, launcher
    if outcome == "done" and not skip_eval:
        from areal_mq.weights import disk_versions

        versions = disk_versions(Path(cfg.run.run_dir) / "weights")
        if versions and versions[-1] == cfg.controller.total_steps:
            final = Path(cfg.run.run_dir) / "weights" / f"v{versions[-1]}"
            _eval_into_run(cfg, str(final), versions[-1], console, f"policy {final.name}")
        else:
            console.print(f"[yellow]the final policy v{cfg.controller.total_steps} is not in run_dir/weights "
                          f"(found {versions[-3:] or 'none'}): no final evaluation[/]")
    _plot_and_summary(cfg, console)
    return outcome, launcher


def claim_ports(cfg, console):
    """The broker ports, before any child starts: free, moved (printed), or exit 2 naming the taken port
    (brokers.auto_ports; areal_mq/launch/ports.py)."""
    from areal_mq.errors import ConfigError
    from areal_mq.launch.ports import claim_broker_ports

    try:
        moved = claim_broker_ports(cfg)
    except ConfigError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2)
    if moved:
        console.print(moved, markup=False, highlight=False)
    return cfg


def _stop_signals_interrupt() -> None:
    """SIGTERM (and SIGINT, even where a non-interactive shell started us with SIGINT ignored) take the same
    path as Ctrl-C: checkpoint, then stop every child. Without this, `kill PID` of the launcher would leave
    its children running and the last batches untrained-but-unsaved."""
    import signal

    def interrupt(signum, frame):
        raise KeyboardInterrupt(signal.Signals(signum).name)

    signal.signal(signal.SIGINT, interrupt)
    signal.signal(signal.SIGTERM, interrupt)


def _eval_into_run(cfg, weights, version, console, label) -> dict:
    from areal_mq.evaluation.heldout import append_result, base_eval_cached, evaluate

    console.print(f"evaluating {label} on {cfg.eval.size} held-out problems…")
    result = base_eval_cached(cfg) if weights is None else evaluate(cfg, weights=weights, version=version)
    append_result(cfg.run.run_dir, result)
    console.print(f"  {label}: strict {result['strict']:.1%}  lenient {result['lenient']:.1%}  "
                  f"(n={result['n']}, {result['seconds']}s)")
    return result


def _plot_and_summary(cfg, console) -> None:
    from areal_mq.telemetry.plots import plot_run, read_jsonl

    run_dir = Path(cfg.run.run_dir)
    try:
        png = plot_run(run_dir)
        console.print(f"plot: {png}")
    except FileNotFoundError as exc:
        console.print(f"no plot: {exc}")
    evals = read_jsonl(run_dir / "eval.jsonl")
    if len(evals) >= 2:
        a, b = evals[0], evals[-1]
        console.print(f"[bold]held-out accuracy[/] (seed {cfg.run.seed}, n={b['n']}): strict {a['strict']:.1%} → "
                      f"{b['strict']:.1%}, lenient {a['lenient']:.1%} → {b['lenient']:.1%}")
