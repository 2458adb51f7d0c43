"""Metrics sinks: where a role's per-step metrics go (a JSONL file always; TensorBoard and W&B on request).

What: `MetricsSinks.from_config(cfg, role, log)` builds the sinks of the config's `metrics` section;
`write(step, metrics)` hands one step's metrics to each of them, `close()` flushes and closes them.
  - JSONL, always: run_dir/metrics.jsonl for the trainer (run_dir/metrics-<role>.jsonl for another role),
    one `json.dumps(metrics)` line per step, appended (what `areal-mq plot`, the progress table and the
    benchmarks read);
  - TensorBoard (`metrics.tensorboard: true`, extra `tensorboard`): event files in run_dir/tensorboard/,
    the finite numeric values tagged "<role>/<key>" at `step`;
  - Weights & Biases (`metrics.wandb: true`, extra `wandb`): a run per process in run_dir/wandb/, offline by
    default (nothing goes over the network; `wandb sync` uploads it later) or live with
    `metrics.wandb_mode: online` (W&B's own login: WANDB_API_KEY or `wandb login`).
  - Prometheus (`metrics.prometheus: true`, extra `prometheus`): this process's /metrics endpoint on
    `metrics.prometheus_host:prometheus_port`, fed by every write (areal_mq/telemetry/prometheus.py).
Why: a sink switched on without its package fails at startup with a ConfigError naming the pip extra,
never silently; a sink that raises while writing is logged once and switched off, so a full disk or a broken
writer never stops training.
How:
    tensorboard --logdir runs/quickstart/tensorboard
    wandb sync runs/quickstart/wandb/offline-run-*
"""
from __future__ import annotations

import json
import logging
import math
import numbers
import time
from pathlib import Path
from types import ModuleType
from typing import Any, Mapping

from areal_mq.errors import require_extra


def scalars(metrics: Mapping[str, Any]) -> dict[str, float]:
    """The finite numbers of `metrics` as floats (strings, lists, NaN and inf are left out)."""
    return {k: float(v) for k, v in metrics.items() if isinstance(v, numbers.Real) and math.isfinite(v)}


def jsonl_path(run_dir: str | Path, role: str) -> Path:
    """run_dir/metrics.jsonl for the trainer (what plots and benchmarks read), run_dir/metrics-<role>.jsonl else."""
    return Path(run_dir) / ("metrics.jsonl" if role == "trainer" else f"metrics-{role}.jsonl")


class JsonlSink:
    """One `json.dumps(metrics)` line per step, appended (the file is opened per line: readers tail it live)."""

    name = "jsonl"

    def __init__(self, path: Path):
        self.path = path

    def write(self, step: int, metrics: Mapping[str, Any]) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(metrics) + "\n")

    def close(self) -> None:
        pass


class TensorBoardSink:
    """An event file in `logdir` (one per process; TensorBoard merges them), flushed after every step."""

    name = "tensorboard"

    def __init__(self, logdir: Path, role: str):
        from tensorboard.compat.proto import event_pb2, summary_pb2
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self._event, self._summary = event_pb2.Event, summary_pb2.Summary
        self.role = role
        self.writer = EventFileWriter(str(logdir))

    def write(self, step: int, metrics: Mapping[str, Any]) -> None:
        values = [self._summary.Value(tag=f"{self.role}/{k}", simple_value=v) for k, v in scalars(metrics).items()]
        if values:
            self.writer.add_event(self._event(wall_time=time.time(), step=step, summary=self._summary(value=values)))
            self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    """A W&B run in run_dir/wandb/ (one per process; metrics.wandb_mode: offline or online), named
    <run name>-<role>, grouped by run name."""

    name = "wandb"

    def __init__(self, wandb: ModuleType, cfg: Any, role: str):
        self.role = role
        self.run = wandb.init(
            project=cfg.metrics.wandb_project, dir=cfg.run.run_dir, mode=cfg.metrics.wandb_mode, name=f"{cfg.run.name}-{role}",
            group=cfg.run.name, job_type=role, config=cfg.model_dump(mode="json"), reinit="create_new",
            # console off: wandb would otherwise wrap stdout/stderr, where the events go
            settings=wandb.Settings(console="off", silent=True))

    def write(self, step: int, metrics: Mapping[str, Any]) -> None:
        self.run.log({f"{self.role}/{k}": v for k, v in scalars(metrics).items()}, step=step)

    def close(self) -> None:
        self.run.finish()


class MetricsSinks:
    """The sinks of one role. `log` (a structlog logger, or None for the stdlib logger) gets one warning per
    sink that fails; that sink is then dropped and the others go on."""

    def __init__(self, sinks: list[Any], role: str, log: Any = None):
        self.sinks, self.role = list(sinks), role
        self.log = log

    @classmethod
    def from_config(cls, cfg: Any, role: str, log: Any = None, worker_id: str = "") -> "MetricsSinks":
        """The sinks `cfg.metrics` (a RunConfig's) asks for; ConfigError when one's package is missing or the
        Prometheus port cannot be bound. `worker_id` names the process on its Prometheus endpoint."""
        run_dir = Path(cfg.run.run_dir)
        wandb = require_extra("wandb", "wandb") if cfg.metrics.wandb else None
        if cfg.metrics.tensorboard:
            require_extra("tensorboard", "tensorboard")
        prometheus = None
        if cfg.metrics.prometheus:
            from areal_mq.telemetry.prometheus import PrometheusSink

            prometheus = PrometheusSink(cfg, role, worker_id, log)  # binds its port now: a clash stops us here
        run_dir.mkdir(parents=True, exist_ok=True)
        sinks: list[Any] = [JsonlSink(jsonl_path(run_dir, role))]
        if cfg.metrics.tensorboard:
            sinks.append(TensorBoardSink(run_dir / "tensorboard", role))
        if wandb is not None:
            sinks.append(WandbSink(wandb, cfg, role))
        if prometheus is not None:
            sinks.append(prometheus)
        return cls(sinks, role, log)

    def write(self, step: int, metrics: Mapping[str, Any]) -> None:
        """One step's metrics to every sink still working."""
        for sink in list(self.sinks):
            try:
                sink.write(step, metrics)
            except Exception as exc:  # noqa: BLE001 - a metrics sink never stops training
                self._drop(sink, "write", exc)

    def close(self) -> None:
        """Flush and close every sink (safe to call twice)."""
        sinks, self.sinks = self.sinks, []
        for sink in sinks:
            try:
                sink.close()
            except Exception as exc:  # noqa: BLE001
                self._drop(sink, "close", exc)

    def _drop(self, sink: Any, during: str, exc: Exception) -> None:
        if sink in self.sinks:
            self.sinks.remove(sink)
        fields = dict(sink=sink.name, during=during, error=f"{type(exc).__name__}: {exc}")
        if self.log is not None:
            self.log.warning("metrics.sink_disabled", **fields)
        else:
            logging.getLogger(__name__).warning("metrics.sink_disabled %s", fields)
