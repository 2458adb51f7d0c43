"""`areal-mq run CONFIG`: start brokers, controller, rollout, reward and trainer processes on one host.

What: writes the resolved config into the run directory (the broker ports checked first: a taken one stops the
run or moves the brokers, brokers.auto_ports, launch/ports.py), starts each process with its log in
run_dir/logs/, divides CPU threads between them (`launcher.threads`), shows live progress, and stops everything
cleanly.
Why a supervisor: a child that dies is reported by name with its exit status, the reason from its log and
the log's path; it is restarted (`launcher.on_child_death: restart`, up to `max_restarts`; the broker
included) or the run stops.
Ctrl-C (SIGINT) asks the trainer to checkpoint (Control "checkpoint" then "shutdown") and waits for it.
The run ends when the trainer exits after `controller.total_steps` versions.
Metrics: with `metrics.prometheus: true` each child serves /metrics on its own port of the block starting at
`metrics.prometheus_port` (in start order: broker, reward, rollout, trainer, controller), checked before anything
starts (inside 1-65535, clear of the broker ports, free) and printed one line per process.
Security: `prepare` creates the run's CURVE key set in run_dir/keys (0700) unless it exists or
`security.keys_dir` names another; every child finds its key there through the config it is given.
"""
from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from areal_mq.config import RunConfig, dump_config
from areal_mq.errors import ConfigError, require_extra
from areal_mq.launch.ports import PORT_NAMES, held, port_free


@dataclass
class Child:
    name: str
    role: str
    args: list[str]
    log_path: Path
    env: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen | None = None
    restarts: int = 0
    metrics_port: int = 0  # its Prometheus endpoint (metrics.prometheus), 0: none





def assign_metrics_ports(cfg: RunConfig, names: list[str], check_free: bool = True) -> dict[str, int]:
    """Each process (in start order) its Prometheus port of the block from `metrics.prometheus_port`.
    ConfigError when the block runs past 65535, overlaps a broker or weight server port, or a port is taken."""
    m, b = cfg.metrics, cfg.brokers
    base, n = m.prometheus_port, len(names)
    move = "move the block with --set metrics.prometheus_port=N"
    if base + n - 1 > 65535:
        raise ConfigError(f"metrics.prometheus_port {base} + {n} processes runs past port 65535; {move}")
    block = range(base, base + n)
    ports = {f"brokers.{name}": getattr(b, name) for name in PORT_NAMES}
    if cfg.trainer.weight_server_port:
        ports["trainer.weight_server_port"] = cfg.trainer.weight_server_port
    clash = {k: v for k, v in ports.items() if v in block}
    if clash:
        raise ConfigError(f"the Prometheus port block {base}-{base + n - 1} (one port for each of {n} processes) "
                          f"overlaps {', '.join(f'{k}={v}' for k, v in clash.items())}; {move}")
    busy = [p for p in block if check_free and not port_free(m.prometheus_host, p)]
    if busy:

        raise ConfigError(f"Prometheus port(s) {', '.join(map(str, busy[:5]))} on {m.prometheus_host} are in use"
                          f"{held(busy[0])} (block {base}-{base + n - 1} for {n} processes); {move}")
    return dict(zip(names, block))


CHECKPOINT_WRITE_MBPS = 100.0  # a conservative disk: the stop grace must cover the trainer's final checkpoint


def checkpoint_bytes(model_dir: str | Path) -> int:
    """What the trainer's checkpoint holds for the model in `model_dir`: 12 bytes per parameter (fp32 weights
    and AdamW's two moments; gradients are not saved), counted from its config.json (launch/plan.py)."""
    from areal_mq.launch.plan import read_shape

    return 12 * read_shape(model_dir).params


def default_stop_grace_s(cfg: RunConfig) -> float:
    """launcher.stop_grace_s, or 30 s plus the trainer's final checkpoint at CHECKPOINT_WRITE_MBPS: a 7B model's
    checkpoint takes minutes to write, and a SIGKILL in the middle of it loses everything since the last one."""
    if cfg.launcher.stop_grace_s is not None:
        return cfg.launcher.stop_grace_s
    try:
        from areal_mq.engines.models import resolve_model

        named = Path(cfg.model.name).expanduser()  # its config.json is all this needs
        nbytes = checkpoint_bytes(named if (named / "config.json").is_file()
                                  else resolve_model(cfg.model.name, cfg.model.cache_dir))
    except Exception:  # noqa: BLE001 - no config to read (a simulated run): the plain default
        return 30.0
    return 30.0 + nbytes / (CHECKPOINT_WRITE_MBPS * 1e6)


def trainer_launch(ranks: int) -> list[str]:
    """The command head of a multi-rank trainer on this host: torch's elastic launcher, one rendezvous on
    loopback (a free port taken now), every rank running `python -m areal_mq.cli`. The launcher supervises the
    agent as one child: torchrun stops every rank when one dies, and forwards SIGTERM to all of them."""
    from areal_mq.launch.ports import free_port

    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks), "--master_addr",
            "127.0.0.1", "--master_port", str(free_port("127.0.0.1")), "-m", "areal_mq.cli"]


class Launcher:
    def __init__(self, cfg: RunConfig, console: Any = None):
        self.cfg = cfg
        self.run_dir = Path(cfg.run.run_dir)
        self.console = console
        self.children: list[Child] = []
        self.stopping = False
        self.failure: str | None = None
        self.evaluator: Any = None  # PeriodicEval (areal_mq.evaluation.periodic) when eval.every > 0
        self.keys: Any = None

    def prepare(self) -> Path:
        from areal_mq.security import Keyring, generate_keys, key_dir

        (self.run_dir / "logs").mkdir(parents=True, exist_ok=True)
        if self.cfg.security.insecure:
            self.say("[bold red]security.insecure: every socket of this run is unauthenticated and unencrypted "
                     "(debugging only)[/]")
        elif self.cfg.security.keys_dir is None:
            generate_keys(key_dir(self.cfg))  # only the missing ones: a resumed run keeps its keys
        self.keys = Keyring.from_config(self.cfg, "launcher")
        path = self.run_dir / "config.yaml"
        path.write_text(dump_config(self.cfg))
        if self.cfg.metrics.prometheus:
            self.plan(path)  # a bad Prometheus port block stops the run here, before anything starts
        if self.cfg.trainer.lora is not None and importlib.util.find_spec("peft") is None:
            require_extra("peft", "lora", "trainer.lora")  # stops here, not as a trainer that dies after the engines
        return path

    def plan(self, config_path: Path) -> list[Child]:
        cfg, lc = self.cfg, self.cfg.launcher
        base = [sys.executable, "-m", "areal_mq.cli"]
        kids = [Child("broker", "broker", [*base, "broker", "--config", str(config_path)],
                      self.run_dir / "logs" / "broker.log")]
        roles = [("reward", lc.reward_workers), ("rollout", lc.rollout_workers), ("trainer", 1), ("controller", 1)]
        if cfg.agent.workflow:  # multi-turn episodes: the controller sends EpisodeJobs to the agent role
            roles.insert(2, ("agent", lc.agent_workers))
        for role, count in roles:
            for i in range(count):
                name = f"{role}-{i}" if count > 1 or role in ("reward", "rollout", "agent") else role
                env = {}
                if role in lc.threads:
                    env = {"OMP_NUM_THREADS": str(lc.threads[role]), "MKL_NUM_THREADS": str(lc.threads[role])}
                visible = cfg.placement.visible(role, i, lc)
                if visible is not None:  # exactly the GPUs placement gives this process (none: an empty list)
                    env["CUDA_VISIBLE_DEVICES"] = visible
                unit = role == "trainer" and lc.trainer_ranks > 1 and lc.backend == "local"  # Ray: ray_unit.py
                head = trainer_launch(lc.trainer_ranks) if unit else base
                kids.append(Child(name, role, [*head, "worker", role, "--config", str(config_path), "--worker-id",
                                               name], self.run_dir / "logs" / f"{name}.log", env))
        if cfg.metrics.prometheus:  # each process its own port of the block
            ports = assign_metrics_ports(cfg, [k.name for k in kids])
            for kid in kids:
                kid.metrics_port = ports[kid.name]
                kid.args += ["--set", f"metrics.prometheus_port={kid.metrics_port}"]
        self.children = kids
        return kids

    def start(self, child: Child) -> None:
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **child.env}
        log = open(child.log_path, "ab")
        child.proc = subprocess.Popen(child.args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                      env=env, start_new_session=True)
        log.close()

    def start_all(self) -> None:
        from areal_mq.client import JobClient

        for child in self.children:
            if self.cfg.metrics.prometheus:
                self.say(f"prometheus: {child.name:<12} http://{self.cfg.metrics.prometheus_host}:"
                         f"{child.metrics_port}/metrics")
            self.start(child)
            if child.role == "broker":
                probe = JobClient(self.cfg.brokers.job_addr, keys=self.keys)
                try:
                    probe.stats(timeout=30)
                finally:
                    probe.close()

    # ------------------------------------------------------------ supervision
    def exit_verdict(self, role: str, code: int | None) -> str:
        """What a child's exit code means: 'done' (the trainer finished the run), 'ignore' (still running, we are
        stopping, or the controller ended by itself after the last version), else 'dead' (restart or fail)."""
        if code is None:
            return "ignore"
        if role == "trainer" and code == 0:
            return "done"
        if self.stopping or (code == 0 and role == "controller"):
            return "ignore"
        return "dead"

    def check_children(self) -> str | None:
        """Handle dead children; returns 'done' when the trainer finished, 'failed' when the run must stop.
        Also the supervision tick for the periodic evaluator (it starts and reaps background evaluations)."""
        if self.evaluator is not None and not self.stopping and (note := self.evaluator.poll()):
            self.say(note)
        for child in self.children:
            code = child.proc.poll() if child.proc else None
            verdict = self.exit_verdict(child.role, code)
            if verdict == "done":
                return "done"
            if verdict == "ignore":
                continue
            reason = describe_exit(code, child.log_path)
            lc = self.cfg.launcher
            # the broker too: its sample store replays its log, workers re-register and clients resubmit
            if lc.on_child_death == "restart" and child.restarts < lc.max_restarts:
                child.restarts += 1
                self.say(f"[yellow]{child.name} died ({reason}); restarting ({child.restarts}/{lc.max_restarts}). "
                         f"Log: {child.log_path}[/]")
                self.event("launcher.child_restarted", child=child.name, role=child.role, pid=child.proc.pid,
                           reason=reason, restarts=child.restarts)
                self.start(child)
                continue
            self.failure = f"{child.name} died ({reason}). Log: {child.log_path}"
            self.event("launcher.child_died", child=child.name, role=child.role, reason=reason)
            return "failed"
        return None

    def wait_for_exit(self, timeout_s: float, check_s: float = 0.1) -> None:
        """The supervisor's tick: sleep up to `timeout_s`, ending as soon as a child process that was running exits,
        so a finished trainer (or a dead child) is acted on within `check_s`, not a whole tick later (issue 58).
        Children without a local process (Ray's actors) are not watched: their tick lasts `timeout_s`."""
        procs = [getattr(c, "proc", None) for c in self.children]  # a Ray trainer unit has none
        running = [p for p in procs if p is not None and p.poll() is None]
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            if any(proc.poll() is not None for proc in running):
                return
            time.sleep(min(check_s, left))

    def event(self, name: str, **fields: Any) -> None:
        """One line in run_dir/events/launcher.jsonl (read by `areal-mq events tail RUN_DIR` like any other)."""
        import json

        folder = self.run_dir / "events"
        record = {"ts": time.time(), "level": "warning", "event": name, "role": "launcher", "worker_id": "launcher",
                  "pid": os.getpid(), **fields}
        try:
            folder.mkdir(parents=True, exist_ok=True)
            with open(folder / "launcher.jsonl", "a") as f:
                f.write(json.dumps(record) + "\n")
        except OSError:  # a full disk (ENOSPC) must not end the supervisor (the soak found it): the line is lost
            pass

    def say(self, text: str) -> None:
        if self.console is not None:
            self.console.print(text)
        else:
            print(text, file=sys.stderr)

    def request_checkpoint_and_stop(self, reason: str) -> None:
        from areal_mq.client import SignalPublisher
        from areal_mq.messages import Control

        pub = SignalPublisher(self.cfg.brokers.bus_in_addr, keys=self.keys)
        try:
            time.sleep(0.3)  # PUB sockets drop what they send before the connection is up
            pub.publish("control", Control(action="checkpoint", reason=reason))
            pub.publish("control", Control(action="shutdown", reason=reason))
            time.sleep(0.2)
        finally:
            pub.close()

    def stop_all(self, grace_s: float | None = None) -> None:
        """Workers first (SIGTERM: drain and checkpoint), the broker last; SIGKILL after the grace period
        (default: launcher.stop_grace_s, else sized by the trainer's checkpoint: default_stop_grace_s)."""
        grace_s = default_stop_grace_s(self.cfg) if grace_s is None else grace_s
        self.stopping = True
        order = [c for c in self.children if c.role != "broker"] + [c for c in self.children if c.role == "broker"]
        for group in (order[:-1], order[-1:]):
            for c in group:
                if c.proc and c.proc.poll() is None:
                    c.proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + grace_s
            for c in group:
                if c.proc is None:
                    continue
                try:
                    c.proc.wait(max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    c.proc.kill()
                    c.proc.wait(5)


def describe_exit(code: int, log_path: Path) -> str:
    why = f"killed by signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
    last = last_error_line(log_path)
    return f"{why}; last log line: {last}" if last else why


def last_error_line(log_path: Path, lines: int = 40) -> str:
    try:
        tail = log_path.read_text(errors="replace").splitlines()[-lines:]
    except OSError:
        return ""
    for line in reversed(tail):
        if any(w in line for w in ("Error", "error", "Traceback", "failed")):
            return line.strip()[:300]
    return tail[-1].strip()[:300] if tail else ""
