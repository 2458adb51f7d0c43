"""`areal-mq worker reward` and `areal-mq reward serve`: the reward role.

What: `RewardServer` is a Role (areal_mq/actor/roles.py) around a RewardExecutor: it takes RewardJobs from the
broker's service "reward", scores them in the executor's pool (`reward.processes` processes = the worker's
capacity) and replies RewardResult. Failures inside reward functions become default rewards plus a
`reward.error` event naming the job and the exception; a job that cannot be scored at all (a task this
worker's config does not define, bad flags) is answered with Error(bad_request): a task name in a job only
selects a configured task, it never names code to load. `serve(fn, broker="tcp://HOST:PORT")` attaches a
reward server for one function to a running broker from any host (the Python API behind
`areal-mq reward serve`).

    broker --RewardJob--> on_job --> executor.submit --(pool process)--> Future
                          runtime.reply(RewardResult) <-- done callback --+
Invariant: every job taken is answered once (reply or Error) unless this process dies, in which case the
broker requeues it to another reward worker. Pause (Control) is the loop's: READY(0) until resume. On
SIGTERM or Control(shutdown): stop taking jobs, finish those in flight, DISCONNECT, stop the pool.
Run: areal-mq worker reward --config configs/quickstart.yaml [--set reward.processes=2]
     areal-mq reward serve my_pkg.rewards:score --broker tcp://10.0.0.2:5555
"""
from __future__ import annotations

import sys
import time
from typing import Any, Callable

from areal_mq.errors import ConfigError, RewardError
from areal_mq.messages import RewardJob
from areal_mq.rewards.config import RewardConfig, TaskConfig
from areal_mq.rewards.executor import RewardExecutor
from areal_mq.rewards.registry import RewardRegistry
from areal_mq.rewards.sandbox.runner import REFUSALS as SANDBOX_REFUSALS
from areal_mq.actor.roles import Role, RoleLoop

DRAIN_TIMEOUT_S = 30.0


class RewardServer(Role):
    """The reward role; owns neither the runtime nor the executor (callers close them)."""

    name = "reward"
    drain_timeout_s = DRAIN_TIMEOUT_S

    def __init__(self, executor: RewardExecutor, runtime: Any):
        super().__init__(runtime)
        self.ex = executor
        self.answered = 0
        self.sandbox_refusals = 0  # completions the code sandbox stopped (network, write, syscall, ... refused)

    def run(self) -> None:
        self.rt.ready(self.ex.capacity, tasks=sorted(self.ex.cfg.tasks))  # '*' = any task: advertises none
        self.log.info("reward.started", service=self.rt.service, capacity=self.ex.capacity,
                      tasks=sorted(self.ex.cfg.tasks) or "none", processes=self.ex.cfg.processes)
        RoleLoop(self.rt, self).run()

    def on_job(self, job: Any) -> None:
        if not isinstance(job.msg, RewardJob):
            self.rt.fail(job, "bad_request", f"reward workers take reward_job, got {job.msg.kind.value}")
            return
        started = time.monotonic()
        try:
            fut = self.ex.submit(job.msg, job_id=job.id)
        except RewardError as exc:
            self.log.error("reward.error", job=job.id, task=job.msg.task[:200], kind="bad_request", error=str(exc))
            self.rt.fail(job, "bad_request", str(exc))
            return
        fut.add_done_callback(lambda f: self._done(job, f, started))

    def _done(self, job: Any, fut: Any, started: float) -> None:
        exc = fut.exception()
        if exc is not None:  # only when the executor is closing under the job
            self.rt.fail(job, "job_failed", f"{type(exc).__name__}: {exc}")
            return
        result = fut.result()
        self.rt.reply(job, result)
        self.answered += 1
        self.sandbox_refusals += sum(str((d or {}).get("reason", "")) in SANDBOX_REFUSALS for d in result.details)
        self.log.debug("reward.job_done", job=job.id, task=job.msg.task, n=len(result.rewards),
                       cached=result.cached, ms=round((time.monotonic() - started) * 1000, 1))
        self.log.debug("reward.completions", job=job.id, prompt_id=job.msg.prompt_id, rewards=result.rewards,
                       reasons=[str((d or {}).get("reason", "")) for d in result.details] or None,
                       errors=result.errors or None)

    def busy(self) -> bool:
        return self.rt.in_flight > 0

    def stats(self) -> dict:
        return {**self.ex.stats(), "answered": self.answered, "in_flight": self.rt.in_flight,
                "sandbox_refusals": self.sandbox_refusals}

    def on_stop(self) -> None:
        self.log.info("reward.stats", answered=self.answered, **self.ex.stats())


def main(cfg: Any, worker_id: str | None = None) -> int:
    return run_worker(cfg, worker_id)


def run_worker(cfg: Any, worker_id: str | None = None, *, registry: RewardRegistry | None = None,
               service: str = "reward") -> int:
    """Start runtime + executor from a RunConfig, serve until stopped, clean up. Returns an exit code."""
    from areal_mq.actor.runtime import WorkerRuntime, default_worker_id

    worker_id = worker_id or default_worker_id("reward")
    log_holder: list = []
    ex = RewardExecutor(cfg.reward, registry, worker_id=worker_id,
                        on_error=lambda rec: log_holder[0].error("reward.error", **rec))
    try:
        ex.validate()
    except RewardError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 2
    rt = WorkerRuntime(cfg, role="reward", service=service, capacity=cfg.reward.processes, worker_id=worker_id,
                       topics=("control",))
    log_holder.append(rt.log)
    try:
        ex.start()
        rt.start()
        RewardServer(ex, rt).run()
    finally:
        rt.close()
        ex.close()
    return 0


def serve(fn: Callable | str, *, broker: str | None = None, config: Any = None, task: str = "*",
          service: str = "reward", processes: int | None = None, timeout_s: float | None = None,
          worker_id: str | None = None, overrides: list[str] | None = None) -> int:
    """Serve one reward function (a callable or 'pkg.mod:func' / registered name) for `task` ('*' = all)
    on the broker at `broker` ('tcp://HOST:PORT'); `config` is a RunConfig or YAML path for the rest.
    Blocks until SIGTERM or Control(shutdown). Callables must be importable (module level)."""
    cfg = build_config(config, broker, overrides)
    registry = RewardRegistry()
    ref = fn
    if callable(fn):
        ref = f"served:{getattr(fn, '__qualname__', 'fn')}"
        registry.register(ref, fn)
    updates: dict = {"tasks": {task: TaskConfig(fn=ref)}}
    if processes is not None:
        updates["processes"] = processes
    if timeout_s is not None:
        updates["timeout_s"] = timeout_s
    reward = RewardConfig.model_validate({**cfg.reward.model_dump(), **updates})
    return run_worker(cfg.model_copy(update={"reward": reward}), worker_id, registry=registry, service=service)


def build_config(config: Any, broker: str | None, overrides: list[str] | None = None) -> Any:
    """A RunConfig from a RunConfig / YAML path / defaults. With `broker` ('tcp://HOST:PORT', the job broker),
    every broker address follows from it: the same host, and the signal bus at PORT+1 (in) and PORT+2 (out),
    the layout `areal-mq broker` and `areal-mq run` bind. A port the config file or --set names explicitly is
    kept, so a bus on other ports is given with --set brokers.bus_in_port=... (never a silent default)."""
    from areal_mq.config import RunConfig, load_config

    if isinstance(config, RunConfig):
        cfg = config
    else:
        cfg = load_config(config, overrides or [])
    if broker:
        host, port = parse_address(broker)
        given = cfg.brokers.model_fields_set
        derived = {"host": host, "job_port": port, "bus_in_port": port + 1, "bus_out_port": port + 2,
                   "store_port": port + 3}
        update = {k: v for k, v in derived.items() if k in ("host", "job_port") or k not in given}
        bad = [k for k, v in update.items() if isinstance(v, int) and v > 65535]
        if bad:
            raise ConfigError(f"broker port {port} leaves no room for {', '.join(bad)} (job port + 1..3); "
                              "set them with --set brokers.<name>=PORT")
        cfg = cfg.model_copy(update={"brokers": cfg.brokers.model_copy(update=update)})
    return cfg


def describe_addresses(cfg: Any) -> str:
    """One line naming where a reward server connects (printed at start so a wrong bus is seen, not guessed)."""
    b = cfg.brokers
    return f"job broker {b.job_addr}, signal bus {b.bus_in_addr} (in) / {b.bus_out_addr} (out)"


def parse_address(address: str) -> tuple[str, int]:
    """'tcp://HOST:PORT' -> (HOST, PORT); ConfigError naming the expected form otherwise."""
    rest = address[len("tcp://"):] if address.startswith("tcp://") else None
    host, _, port = (rest or "").rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"broker address {address!r} must look like tcp://HOST:PORT, e.g. tcp://10.0.0.2:5555")
    return host, int(port)
