"""`areal-mq` command line. Every command imports its heavy modules lazily so `--help` stays fast.

    areal-mq run configs/quickstart.yaml              # the whole system on one host
    areal-mq broker --config FILE [--only job,bus,store]
    areal-mq worker ROLE --config FILE [--set a.b=v]  # ROLE: rollout, reward, trainer, controller, agent, echo
    areal-mq config show FILE [--set a.b=v]
    areal-mq trace RUN_DIR GROUP_ID [--json]            # one group's journey: generated, rewarded, trained
    areal-mq top RUN_DIR [--once]                      # live view of a running job (docs/operating.md)
    areal-mq events tail [RUN_DIR] [--follow] [--bus tcp://... --keys DIR] [--role R] [--event 'glob'] [KEY=VALUE ...]
    areal-mq keys generate DIR [--name rollout-host7]  # CURVE keys for multi-host runs and external workers
    areal-mq serve-openai --config FILE [--host 127.0.0.1] [--port 8000]  # OpenAI-compatible endpoint (docs/openai.md)
"""
from __future__ import annotations

import sys
from typing import List, Optional

import typer

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Fully asynchronous RL over ZeroMQ.")
config_app = typer.Typer(no_args_is_help=True, help="Inspect run configs.")
events_app = typer.Typer(no_args_is_help=True, help="Read structured events.")
keys_app = typer.Typer(no_args_is_help=True, help="CURVE keys that authenticate every socket (docs/security.md).")
app.add_typer(config_app, name="config")
app.add_typer(events_app, name="events")
app.add_typer(keys_app, name="keys")
checkpoint_app = typer.Typer(no_args_is_help=True, help="Trainer checkpoints (run_dir/checkpoints/stepNNNNNNNN).")
app.add_typer(checkpoint_app, name="checkpoint")

from areal_mq.launch.cli import SET_HELP  # noqa: E402  (typer only: --help stays fast)

SetOpt = typer.Option(None, "--set", "-s", help=SET_HELP)
ConfigOpt = typer.Option(None, "--config", "-c", help="YAML run config (defaults if omitted).")
InsecureOpt = typer.Option(False, "--insecure", help="Unauthenticated plaintext sockets (debugging only; loopback "
                           "only; warns at every start). Same as --set security.insecure=true.")


def _version(value: bool) -> None:
    if value:
        from areal_mq import __version__

        typer.echo(f"areal-mq {__version__}")
        raise typer.Exit()


@app.callback()
def _root(version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                       help="Show the version and exit.")) -> None:
    """areal-mq: rollout workers generate, trainers train, ZeroMQ brokers connect them."""


def _load(path: Optional[str], overrides: Optional[List[str]], insecure: bool = False):
    from areal_mq.config import load_config
    from areal_mq.errors import ConfigError

    try:
        return load_config(path, [*(overrides or []), *(["security.insecure=true"] if insecure else [])])
    except ConfigError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2)


@config_app.command("show")
def config_show(path: Optional[str] = typer.Argument(None, help="YAML run config."), set_: Optional[List[str]] = SetOpt,
                plain: bool = typer.Option(False, "--plain", help="Plain YAML without field documentation.")) -> None:
    """Print the resolved config, every field with its documentation."""
    from areal_mq.config import documented_yaml, dump_config

    cfg = _load(path, set_)
    typer.echo(dump_config(cfg) if plain else documented_yaml(cfg))


@app.command()
def broker(config: Optional[str] = ConfigOpt, set_: Optional[List[str]] = SetOpt,
           only: Optional[str] = typer.Option(None, help="Comma list of job,bus,store (default: all)."),
           insecure: bool = InsecureOpt) -> None:
    """Run the job broker, signal bus and sample store (binds brokers.host, loopback by default)."""
    cfg = _load(config, set_, insecure)
    parts = None
    if only:
        parts = {p.strip() for p in only.split(",") if p.strip()}
        bad = parts - {"job", "bus", "store"}
        if bad:
            typer.echo(f"error: --only takes job, bus, store; got {', '.join(sorted(bad))}", err=True)
            raise typer.Exit(2)
    from areal_mq.brokers.main import main as broker_main

    raise typer.Exit(broker_main(cfg, parts))


def _builtin_workflows() -> list[str]:
    from areal_mq.workflows.builtin import BUILTINS  # the registry: help text never keeps a second list

    return list(BUILTINS)


@app.command()
def worker(role: str = typer.Argument(..., help="Worker role, e.g. rollout, reward, trainer, controller."),
           config: Optional[str] = ConfigOpt, set_: Optional[List[str]] = SetOpt,
           worker_id: Optional[str] = typer.Option(None, help="Stable id (default: role-host-pid)."),
           workflow: Optional[str] = typer.Option(None, help="agent only: a built-in workflow "
                                                  f"({', '.join(_builtin_workflows())}) or module:function "
                                                  "(= agent.workflow)."),
           insecure: bool = InsecureOpt) -> None:
    """Start one worker process of ROLE, connected to the brokers in the config."""
    import importlib

    from areal_mq.errors import ConfigError, SecurityError
    from areal_mq.workers import ROLES

    if role not in ROLES:
        typer.echo(f"error: unknown role {role!r}; available: {', '.join(sorted(ROLES))}", err=True)
        raise typer.Exit(2)
    if workflow is not None and role != "agent":
        typer.echo(f"error: --workflow is for the agent role, not {role!r}", err=True)
        raise typer.Exit(2)
    cfg = _load(config, [*(set_ or []), *([f"agent.workflow={workflow}"] if workflow else [])], insecure)
    module, func = ROLES[role].split(":")
    try:
        code = getattr(importlib.import_module(module), func)(cfg, worker_id) or 0
    except (SecurityError, ConfigError) as exc:  # e.g. a metrics sink whose package is missing
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2)
    raise typer.Exit(code)


@app.command("serve-openai")
def serve_openai(config: Optional[str] = ConfigOpt, set_: Optional[List[str]] = SetOpt,
                 host: str = typer.Option("127.0.0.1", help="Interface to bind (loopback by default)."),
                 port: int = typer.Option(8000, help="TCP port (0: any free port; the address is printed)."),
                 broker: Optional[str] = typer.Option(None, help="Job broker address (default: brokers.job_port "
                                                      "of the config)."),
                 api_key_env: str = typer.Option("AREAL_MQ_OPENAI_KEY", help="Environment variable holding the API "
                                                 "key clients must send (Bearer); required off loopback."),
                 max_tokens: int = typer.Option(1024, help="Largest max_tokens a request may ask for."),
                 timeout: float = typer.Option(300.0, help="Seconds one call may wait for its generation."),
                 tool_family: str = typer.Option("auto", help="How tools are offered and calls parsed: auto (from "
                                                 "the chat template) or a family of docs/openai.md's Tools table."),
                 insecure: bool = InsecureOpt) -> None:
    """Serve /v1/chat/completions and /v1/models backed by the job broker; record episodes (docs/openai.md)."""
    import os

    from areal_mq.errors import ArealError
    from areal_mq.openai.server import serve, serve_config

    cfg = _load(config, set_, insecure)
    try:
        scfg = serve_config(cfg, host, port, os.environ.get(api_key_env, ""), max_tokens, timeout, tool_family)
        code = serve(cfg, scfg, broker)
    except (ArealError, OSError) as exc:  # a taken port, a missing key, an unknown model
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2)
    raise typer.Exit(code)


@checkpoint_app.command("export")
def checkpoint_export(checkpoint: str = typer.Argument(..., help="A checkpoint directory (run_dir/checkpoints/"
                                                       "stepNNNNNNNN, ddp or fsdp, any world size, or trainer.lora; "
                                                       "a checkpoints folder means its newest) or a Hugging Face "
                                                       "model directory."),
                      out: str = typer.Argument(..., help="The directory to write; it must not exist or be empty "
                                                "unless --force."),
                      dtype: Optional[str] = typer.Option(None, help="Weight dtype of the export: bfloat16 (the "
                                                          "default, what inference engines load) or float32 (the "
                                                          "trainer's fp32 master weights, exactly); with --adapter "
                                                          "the default is the adapter as trained (fp32)."),
                      max_shard_size: str = typer.Option("5GB", help="Largest safetensors file, e.g. 5GB (10^9 "
                                                         "bytes), 500MB, 2GiB; a tensor larger gets a file of its "
                                                         "own."),
                      force: bool = typer.Option(False, help="Replace a non-empty OUT (only once the new export "
                                                 "is complete)."),
                      progress: bool = typer.Option(True, help="A progress bar over the tensors (on a terminal)."),
                      base: Optional[str] = typer.Option(None, help="LoRA checkpoint: the base model directory "
                                                         "(default: the path in its base_model.json); its sha256 "
                                                         "must be the one the adapter was trained on."),
                      adapter: bool = typer.Option(False, "--adapter", help="LoRA checkpoint: write a PEFT adapter "
                                                   "directory (adapter_model.safetensors + adapter_config.json "
                                                   "naming the base) instead of merged weights.")) -> None:
    """Write the model directory users deploy: sharded safetensors (model-0000i-of-0000n + model.safetensors.index.json)
    in --dtype, config.json, tokenizer and generation_config, streamed tensor by tensor from the checkpoint (memory:
    one tensor, never the whole model; docs/bigger-models.md#export). A LoRA checkpoint is merged into its base
    tensor by tensor, or written as a PEFT adapter directory with --adapter."""
    from pathlib import Path

    from areal_mq.algorithms.export import export_model, resolve_source
    from areal_mq.algorithms.export import export_adapter
    from areal_mq.errors import ArealError

    try:
        if adapter:
            files = export_adapter(resolve_source(checkpoint), Path(out), base, dtype, force)
            typer.echo(f"exported the LoRA adapter ({', '.join(files)}) to {out}")
            return
        done = export_model(checkpoint, out, dtype=dtype or "bfloat16", max_shard_size=max_shard_size, force=force,
                            progress=progress, base=base)
    except (ArealError, OSError) as exc:  # a missing checkpoint or base, an unknown dtype, a full disk
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2)
    typer.echo(f"exported {done.tensors} tensors ({done.total_size / 1e9:.2f} GB, {done.dtype}) in "
               f"{len(done.files)} file(s) to {done.out}")


@keys_app.command("generate")
def keys_generate(directory: str = typer.Argument(..., help="Key directory to create (mode 0700)."),
                  name: Optional[List[str]] = typer.Option(
                      None, "--name", "-n", help="Only this key (ROLE or ROLE-SUFFIX, e.g. rollout-host7); "
                      "repeatable. Default: one key per role."),
                  overwrite: bool = typer.Option(False, help="Replace existing keys (invalidates copies).")) -> None:
    """Create CURVE key pairs: NAME.key (public, copy anywhere) and NAME.key_secret (keep on its host)."""
    from areal_mq.errors import SecurityError
    from areal_mq.security import ROLES, generate_keys

    try:
        made = generate_keys(directory, name or ROLES, overwrite=overwrite)
    except SecurityError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2)
    typer.echo(f"{directory}: created {', '.join(made) or 'nothing (all keys exist)'}")
    typer.echo("Every host needs the *.key public files; each process needs only its own NAME.key_secret "
               "(set security.keys_dir, and security.key_name for a ROLE-SUFFIX key).")


@events_app.command("tail")
def events_tail(run_dir: Optional[str] = typer.Argument(None, help="Run directory (reads run_dir/events/*.jsonl)."),
                where: Optional[List[str]] = typer.Argument(None, help="KEY=VALUE filters on any event field."),
                follow: bool = typer.Option(False, "--follow", "-f", help="Keep printing new events."),
                bus: Optional[str] = typer.Option(None, help="Live from the signal bus XPUB address instead."),
                keys: Optional[str] = typer.Option(None, "--keys", help="Key directory for --bus (default "
                                                   "RUN_DIR/keys); its observer key is used."),
                insecure: bool = typer.Option(False, "--insecure", help="--bus without CURVE (an insecure run)."),
                role: Optional[str] = typer.Option(None, help="Only this role."),
                event: Optional[str] = typer.Option(None, help="Event name glob, e.g. 'broker.*'."),
                level: str = typer.Option("debug", help="Minimum level: debug, info, warning, error."),
                as_json: bool = typer.Option(False, "--json", help="Raw JSON lines."),
                limit: Optional[int] = typer.Option(None, help="Stop after this many events."),
                duration: Optional[float] = typer.Option(None, help="Stop after this many seconds.")) -> None:
    """Show events from every process, filtered, pretty or as JSON."""
    from pathlib import Path

    from areal_mq.telemetry.log import LEVELS
    from areal_mq.telemetry.tail import EventFilter, emit, iter_bus, iter_files, parse_where

    if level not in LEVELS:
        typer.echo(f"error: --level must be one of {', '.join(LEVELS)}", err=True)
        raise typer.Exit(2)
    if run_dir and "=" in run_dir:  # only filters were given
        where, run_dir = [run_dir, *(where or [])], None
    try:
        keep = EventFilter(role=role, event=event, level=level, where=parse_where(where or []))
    except ValueError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2)
    if bus:
        records = iter_bus(bus, stop_after_s=duration, keys=_observer_keys(keys, run_dir, insecure))
    elif run_dir:
        try:
            records = iter_files(Path(run_dir), follow, stop_after_s=duration)
            records = _peek(records)
        except FileNotFoundError as exc:
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(2)
    else:
        typer.echo("error: give a RUN_DIR or --bus tcp://HOST:PORT", err=True)
        raise typer.Exit(2)
    try:
        emit(records, keep, as_json, limit=limit)
    except KeyboardInterrupt:
        pass


@app.command()
def plan(config: Optional[str] = typer.Argument(None, help="YAML run config (default: the built-in defaults)."),
         set_: Optional[List[str]] = SetOpt,
         device_gib: Optional[float] = typer.Option(None, "--device-gib", help="Memory of one GPU in GiB (default: "
                                                    "the first CUDA device's where the trainer runs on CUDA, else "
                                                    "the host's memory shared by every process).")) -> None:
    """The memory each process of a run will need, against what it gets; exit 2 when something cannot fit."""
    from areal_mq.errors import ArealError
    from areal_mq.launch.plan import make_plan

    try:
        result = make_plan(_load(config, set_), device_gib=device_gib)
    except ArealError as exc:  # a model that is neither here, a known name nor a public shape: one line
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2)
    typer.echo(result.table())
    if result.refusals:
        raise typer.Exit(2)


@app.command()
def trace(run_dir: str = typer.Argument(..., help="Run directory (reads run_dir/events/*.jsonl and the store log)."),
          ident: str = typer.Argument(..., metavar="SAMPLE_OR_GROUP_ID", help="A group id (g0000003-...), or one "
                                      "sample of it: GROUP-eN or GROUP:N."),
          as_json: bool = typer.Option(False, "--json", help="The timeline as one JSON object.")) -> None:
    """The journey of one group or sample: admitted, generated, rewarded, stored, leased, trained."""
    from pathlib import Path

    from areal_mq.brokers.sample_log_reader import read_sample
    from areal_mq.telemetry.trace import TraceError
    from areal_mq.telemetry.trace_view import load, render, to_json

    try:
        timeline = load(Path(run_dir), ident, read_sample)
    except (FileNotFoundError, TraceError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2)
    if as_json:
        typer.echo(to_json(timeline))
    else:
        render(timeline)


@app.command()
def top(target: str = typer.Argument(..., help="A run directory (its config.yaml and keys/) or a YAML run config."),
        set_: Optional[List[str]] = SetOpt,
        once: bool = typer.Option(False, "--once", help="Print one frame and exit."),
        interval: float = typer.Option(2.0, help="Seconds between frames."),
        listen: float = typer.Option(3.0, help="--once: seconds to listen to the bus before printing."),
        insecure: bool = InsecureOpt) -> None:
    """A live view of a running job: roles and workers, queues, throughput, staleness, warnings."""
    from areal_mq.errors import ArealError
    from areal_mq.telemetry.top import run_top, top_config

    try:
        cfg = top_config(target, [*(set_ or []), *(["security.insecure=true"] if insecure else [])])
        code = run_top(cfg, once=once, interval_s=interval, listen_s=listen)
    except (ArealError, FileNotFoundError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2)
    raise typer.Exit(code)


def _observer_keys(keys_dir: Optional[str], run_dir: Optional[str], insecure: bool):
    from pathlib import Path

    from areal_mq.errors import SecurityError
    from areal_mq.security import Keyring

    if insecure:
        return Keyring.insecure()
    if not keys_dir and not run_dir:
        typer.echo("error: --bus needs the run's keys: --keys DIR (or RUN_DIR), or --insecure for an insecure run",
                   err=True)
        raise typer.Exit(2)
    try:
        return Keyring.load(keys_dir or Path(run_dir) / "keys", "observer")
    except SecurityError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2)


def _peek(it):
    """Start a generator so errors such as a missing folder surface before printing begins."""
    first = next(it, None)

    def chain():
        if first is not None:
            yield first
        yield from it

    return chain()


def main() -> None:
    from areal_mq.launch import cli as launch_cli
    from areal_mq.rewards import cli as reward_cli

    app.add_typer(reward_cli.app, name="reward")  # sub-apps that live next to their components
    launch_cli.register(app)
    try:
        app()
    except SystemExit as done:  # every command, as a program (not under a test's CliRunner, which calls `app`)
        from areal_mq.actor.exit import exit_now

        if isinstance(done.code, str):
            print(done.code, file=sys.stderr)
        # without the interpreter's teardown of torch: seconds a process, on a run's critical path (actor/exit.py)
        exit_now(done.code if isinstance(done.code, int) else 0 if done.code is None else 1)


if __name__ == "__main__":
    sys.exit(main())
