"""The role loop every role runs on: the role writes hooks, the loop and its middleware do the rest.

What: a role (workers/rollout.py, reward.py, trainer.py, controller.py, agent.py, echo.py) subclasses `Role` and
fills in the hooks it needs; `RoleLoop(runtime, role).run()` drives them from one thread. The runtime is the
WorkerRuntime (areal_mq/actor/runtime.py), a WorkerLink in the swarm (workers/swarm.py drives the hooks itself),
or None (a trainer rank other than 0 under `accelerate launch`: no sockets, no signals).

    while not role.should_stop(runtime.stopping):
        each signal  ──► middleware.signal ──► role.on_signal(msg)   (WeightsReady, Control)
        role.on_tick() ─────────────────────────────────────────────► True = it did work, do not wait
        each job     ──► role.on_job(job)                             (link.Job: id + typed message)
        middleware.tick
    drain: READY(0); role.on_tick() while role.busy() (until role.drain_timeout_s); role.on_stop(); middleware.close

Why middleware (dramatiq's): cross-cutting concerns are written once, as hooks, not as edits to every loop:
- `PauseControl`: Control(pause|resume) for this role (or for every role) sets `role.paused` and, for a role
  with a broker service, announces READY(0) / READY(capacity) so the broker sends nothing new meanwhile, and
  calls role.on_pause(paused). What a paused role stops doing itself is its own: the rollout worker pauses its
  engine (Engine.pause: in-flight sequences keep their state; vLLM stops generating in the background too), the
  trainer takes no batch, the controller admits no prompt (answers are still collected).
- `StatsReport`: every `every_s`, `role.stats()` as one `{role}.stats` event (and to the metrics sinks:
  TensorBoard, W&B, and with `metrics.prometheus` this process's /metrics endpoint).
- drain on SIGTERM / Control(shutdown): the runtime sets `stopping`; the loop drains as above, then the
  caller closes the runtime (DISCONNECT: the broker requeues whatever was not answered).
A new concern subclasses `Middleware` and is passed in: `RoleLoop(rt, role, middleware=[...])`.
"""
from __future__ import annotations

import time
from typing import Any, Iterable

from areal_mq.messages import Control


class Role:
    """Hooks a role overrides; every one runs on the loop's thread. `rt`: the WorkerRuntime, a WorkerLink (in
    the swarm), or None."""

    name = "role"
    drain_timeout_s = 0.0  # how long the loop keeps ticking a busy role after a stop request
    idle_wait_s = 0.05  # how long the loop waits for a job when on_tick did nothing
    stats_every_s = 5.0  # `{name}.stats` (and metrics sinks) period; 0: the role reports otherwise

    def __init__(self, rt: Any):
        self.rt = rt
        self.log = rt.log if rt is not None else None
        self.paused = False

    def on_job(self, job: Any) -> None:
        self.rt.fail(job, "bad_request", f"{self.name} workers take no jobs, got {job.msg.kind.value}")

    def on_signal(self, msg: Any) -> None:
        """A WeightsReady or Control from the bus (pause/resume/shutdown are already handled by the loop)."""

    def on_tick(self) -> bool:
        """Advance own work (an engine step, a train step, admission). True when it did something."""
        return False

    def busy(self) -> bool:
        """Work in flight that a drain should let finish."""
        return False

    def should_stop(self, stopping: bool) -> bool:
        """End the loop? `stopping`: SIGTERM or Control(shutdown) reached this process."""
        return stopping

    def on_stop(self) -> None:
        """After the drain (abort what is left, final checkpoint, final stats)."""

    def on_pause(self, paused: bool) -> None:
        """Control(pause) / Control(resume) changed `self.paused` (already set when this is called)."""

    def stats(self) -> dict:
        return {}

    @property
    def capacity(self) -> int:
        return self.rt.capacity if self.rt is not None else 0


class Middleware:
    """A cross-cutting concern on the role loop: every hook is a no-op unless overridden."""

    def signal(self, loop: "RoleLoop", msg: Any) -> None:
        """A bus message, before role.on_signal sees it."""

    def tick(self, loop: "RoleLoop") -> None:
        """The end of each round of the loop."""

    def close(self) -> None:
        """The loop has ended (after role.on_stop)."""


class PauseControl(Middleware):
    """Control(pause|resume) -> role.paused, and READY(0) / READY(capacity) for a role the broker sends jobs."""

    def __init__(self) -> None:
        self.capacity = 0

    def signal(self, loop: "RoleLoop", msg: Any) -> None:
        role, rt = loop.role, loop.rt
        if not isinstance(msg, Control) or msg.action not in ("pause", "resume") or \
                msg.target_role not in ("", role.name):
            return
        pause = msg.action == "pause"
        if pause == role.paused:
            return
        role.paused = pause
        role.on_pause(pause)
        if rt is not None and rt.service is not None:
            if pause:
                self.capacity = rt.capacity
            rt.ready(0 if pause else self.capacity)
        if role.log is not None:
            role.log.info(f"{role.name}.control", action=msg.action, reason=msg.reason)


class StatsReport(Middleware):
    """`{role}.stats` every `every_s` seconds from role.stats() (numbers only: the dashboards plot them), and
    the same numbers to the metrics sinks (areal_mq/telemetry/metrics.py) when `sinks` is given: TensorBoard / W&B
    curves of every role, not only the trainer's, stepped by the report's number."""

    def __init__(self, every_s: float = 5.0, sinks: Any = None):
        self.every_s, self.sinks = every_s, sinks
        self.last = time.monotonic()
        self.reports = 0

    def tick(self, loop: "RoleLoop") -> None:
        now = time.monotonic()
        if now - self.last < self.every_s or loop.role.log is None:
            return
        self.last = now
        stats = loop.role.stats()
        if stats:
            loop.role.log.info(f"{loop.role.name}.stats", **stats)
            if self.sinks is not None:
                self.sinks.write(self.reports, stats)
                self.reports += 1

    def close(self) -> None:
        if self.sinks is not None:
            self.sinks.close()


def stats_sinks(cfg: Any, role: str, log: Any, worker_id: str = "") -> Any:
    """Metrics sinks for a role's periodic stats when the config asks for TensorBoard, W&B or Prometheus (else
    None: the `{role}.stats` events already carry them)."""
    metrics = getattr(cfg, "metrics", None)
    if metrics is None or not (metrics.tensorboard or metrics.wandb or metrics.prometheus):
        return None
    from areal_mq.telemetry.metrics import MetricsSinks

    return MetricsSinks.from_config(cfg, role, log, worker_id)


class RoleLoop:
    """Drives one role's hooks from one thread (see the module docstring); `middleware` defaults to
    [PauseControl(), StatsReport(role.stats_every_s)]."""

    def __init__(self, rt: Any, role: Role, middleware: Iterable[Middleware] | None = None):
        self.rt, self.role = rt, role
        if middleware is None:
            sinks = (stats_sinks(getattr(rt, "cfg", None), role.name, role.log, getattr(rt, "worker_id", ""))
                     if role.stats_every_s else None)
            middleware = [PauseControl(), StatsReport(role.stats_every_s or 5.0, sinks)]
        self.middleware = list(middleware)

    def run(self) -> None:
        role = self.role
        while not role.should_stop(self.rt is not None and self.rt.stopping):
            self.round(accept=True)
        if self.rt is not None and self.rt.service is not None:
            self.rt.ready(0)  # drain: nothing new, finish what runs
        deadline = time.monotonic() + role.drain_timeout_s
        while role.busy() and time.monotonic() < deadline:
            self.round(accept=False)
        role.on_stop()
        for m in self.middleware:
            m.close()

    def round(self, accept: bool) -> None:
        role, rt = self.role, self.rt
        if rt is not None:
            while (env := rt.next_signal()) is not None:
                for m in self.middleware:
                    m.signal(self, env.msg)
                role.on_signal(env.msg)
        did = role.on_tick()
        if rt is not None and accept and rt.service is not None:
            job = rt.next_job(timeout=0.0 if did else role.idle_wait_s)
            while job is not None:
                role.on_job(job)
                job = rt.next_job()
        elif not did:
            time.sleep(role.idle_wait_s if accept else 0.01)
        for m in self.middleware:
            m.tick(self)
