"""One loop for every role: the role writes hooks, the loop and its middleware do the rest.

What: a role (workers/rollout.py, reward.py, trainer.py, controller.py, echo.py) subclasses `Role` and fills in
the hooks it needs; `RoleLoop(runtime, role).run()` drives them from one thread:

    while not role.should_stop(runtime.stopping):
        each signal  ──► middleware.signal ──► role.on_signal(msg)   (WeightsReady, Control)
        role.on_tick() ─────────────────────────────────────────────► True = it did work, do not wait
        each job     ──► role.on_job(job)                             (the runtime's Job: id + typed message)
        middleware.tick
    drain: READY(0); role.on_tick() while role.busy() (until role.drain_timeout_s); role.on_stop()

Cross-cutting concerns are middleware, written once:
- `PauseControl`: Control(pause|resume) for this role (or for every role) sets `role.paused` and, for a role
  with a broker service, announces READY(0) / READY(capacity) so the broker sends nothing new meanwhile, and
  calls role.on_pause(paused). What a paused role stops doing itself is its own: the rollout worker pauses its
  engine (Engine.pause: in-flight sequences keep their state; vLLM stops generating in the background too), the
  trainer takes no batch, the controller admits no prompt (answers are still collected).
- `StatsReport`: every `every_s`, `role.stats()` as one `{role}.stats` event.
- drain on SIGTERM / Control(shutdown): the runtime sets `stopping`; the loop drains as above, then the
  caller closes the runtime (DISCONNECT: the broker requeues whatever was not answered).
The runtime may be None (a trainer rank other than 0 under `accelerate launch`: no sockets, no signals).
"""
from __future__ import annotations

import time
from typing import Any, Iterable

from areal_mq.messages import Control


class Role:
    """Hooks a role overrides; every one runs on the loop's thread. `rt` is the WorkerRuntime (or None)."""

    name = "role"
    drain_timeout_s = 0.0  # how long the loop keeps ticking a busy role after a stop request
    idle_wait_s = 0.05  # how long the loop waits for a job when on_tick did nothing

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


class PauseControl:
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

    def tick(self, loop: "RoleLoop") -> None:
        pass


class StatsReport:
    """`{role}.stats` every `every_s` seconds from role.stats() (numbers only: the dashboards plot them)."""

    def __init__(self, every_s: float = 5.0):
        self.every_s = every_s
        self.last = time.monotonic()

    def signal(self, loop: "RoleLoop", msg: Any) -> None:
        pass

    def tick(self, loop: "RoleLoop") -> None:
        now = time.monotonic()
        if now - self.last < self.every_s or loop.role.log is None:
            return
        self.last = now
        stats = loop.role.stats()
        if stats:
            loop.role.log.info(f"{loop.role.name}.stats", **stats)


class RoleLoop:
    def __init__(self, rt: Any, role: Role, middleware: Iterable[Any] | None = None):
        self.rt, self.role = rt, role
        self.middleware = list(middleware) if middleware is not None else [PauseControl(), StatsReport()]

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
            time.sleep(0.01 if not accept else min(role.idle_wait_s, 0.05))
        for m in self.middleware:
            m.tick(self)
