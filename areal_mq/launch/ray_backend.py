"""`areal-mq run CONFIG --backend ray [--address HOST:PORT]`: the processes of a run placed as Ray actors.

What: the same processes as the local launcher (areal_mq/launch/launcher.py) — `areal-mq broker` and
`areal-mq worker ROLE --config run_dir/config.yaml --worker-id NAME` — each owned by one Ray actor
(`RoleProcess`) on the node its resources choose. This process (the driver) places them, supervises them,
shows progress and stops them exactly like the local launcher, whose prepare/plan/progress it reuses.
Why a subprocess per actor, not the role's main() inside the actor: a role owns its process — SIGTERM means
drain, it runs its own I/O thread, sets torch's thread count and may fork a reward pool — while a Ray worker
process belongs to Ray (its signal handlers, its threads). The subprocess is exactly what `areal-mq worker`
runs on any host; the actor only starts, reports and stops it.

Placement (launch/ray_placement.py has the rules): a node offering the resource `areal_<role>: N` takes N actors
of that role (one unit each), else the defaults:

    broker      areal_brokers, else the driver's node. Probed first: the node's IP becomes brokers.host and
                free ports there brokers.*_port of the config every actor reads; pinned to that node
    controller  areal_controller, else the brokers' node (pinned)
    trainer     areal_trainer, else one GPU per rank when the cluster has them, else num_cpus =
                launcher.threads.trainer (publish_mode zmq: probed and pinned like the broker; its IP is
                trainer.weight_server_host). More than one rank: one unit in a placement group (ray_unit.py);
                sharded publishing over several nodes: each rank's node IP in trainer.weight_server_hosts
    rollout     areal_rollout, else num_cpus = launcher.threads.rollout (default 1); SPREAD over the nodes
    reward      areal_reward, else no resources; SPREAD

`launcher.ray_resources.ROLE` ({num_cpus: 2, num_gpus: 1, any_custom: 1}) replaces a role's default;
`placement.ROLE.gpus_per_process: N` gives each of its actors N GPUs. Each role process sees exactly the GPUs
Ray gave its actor (CUDA_VISIBLE_DEVICES, checked); a GPU demand the cluster cannot meet is refused first.

Restarts: the driver polls every actor (`RoleProcess.info`). A role process that exits (kill -9 included) is
handled like the local launcher handles a dead child: with `launcher.on_child_death: restart` the driver
kills the actor with restart allowed and Ray starts it again (constructor = the role again); a lost actor
(its node removed, its Ray worker killed) is restarted by Ray itself on any node its resources allow. Both
count against `launcher.max_restarts` (the actors' max_restarts). The role process dies with its actor
(PR_SET_PDEATHSIG), so a lost actor never leaves a second copy of its role running. The roles are
restart-safe (tests/integration/test_chaos.py); only the two pinned anchors need their node back.
Needs: the run directory (config, keys, logs, weights, checkpoints, the store's log) on a filesystem every
node shares (automatic on one machine), and CURVE keys: brokers.host is a node IP, so --insecure is refused.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from areal_mq.config import config_from_dict
from areal_mq.errors import ConfigError
from areal_mq.launch.launcher import Child, Launcher, default_stop_grace_s, describe_exit
from areal_mq.launch.ray_placement import (ROLES, actor_devices, check_gpu_demand, check_ray_resources,  # noqa: F401
                                           is_custom, role_request, uses_placement)
from areal_mq.launch.ray_probe import first_line, probe_node
from areal_mq.launch.ray_unit import TrainerUnit

PLACE_TIMEOUT_S = 300.0  # an actor not (re)placed this long stops the run: no node offers what it asks for
CALL_TIMEOUT_S = 5.0


def import_ray() -> Any:
    try:
        import ray
    except ImportError as exc:
        raise ConfigError(f"launcher.backend: ray needs Ray, which is not installed here ({exc}): "
                          "pip install -e .[ray]   (or run without --backend ray: the local launcher)") from None
    return ray


# ---------------------------------------------------------------- placement
def ray_options(request: dict, node_id: str | None = None, spread: bool = False) -> dict:
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    opts = dict(request)
    if node_id is not None:
        opts["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node_id, soft=False)
    elif spread:
        opts["scheduling_strategy"] = "SPREAD"
    return opts


def check_reachable(address: str | None, timeout_s: float = 10.0) -> None:
    """Fail fast on a HOST:PORT nobody listens on (ray.init would retry it for minutes)."""
    import socket

    host, _, port = (address or "").rpartition(":")
    if not host or not port.isdigit() or "://" in address:
        return  # None, 'auto', ray://...: Ray's own resolution
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except OSError as exc:
        raise ConfigError(f"cannot join the Ray cluster at {address}: {exc} (--address HOST:PORT of a node started "
                          "with `ray start --head`)") from None


# ---------------------------------------------------------------- the actor
def _die_with_parent(parent_pid: int) -> None:
    """preexec_fn of a role process (Linux): SIGKILL when the actor's process ends, as if its node died."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent_pid:  # the actor died before prctl took effect
        os._exit(1)


class RoleProcess:
    """A Ray actor owning one role process (`python -m areal_mq.cli broker|worker ...`), started in the
    constructor, so a restarted actor is a restarted role (a trainer rank's is started by its unit: `launch`).
    Methods run on the actor's main thread, the one that forked the role (PR_SET_PDEATHSIG follows the forking
    thread). The process sees exactly the GPUs Ray gave the actor (ray_placement.actor_devices)."""

    def __init__(self, name: str, role: str, argv: list[str], env: dict, log_path: str, cwd: str | None,
                 gpus: float = 0, placed: bool = False, start: bool = True):
        import ray

        self.name, self.role, self.log_path, self.argv, self.env = name, role, Path(log_path), argv, env
        self.cwd = cwd if cwd and os.path.isdir(cwd) else None
        self.node_id = ray.get_runtime_context().get_node_id()
        self.ip = ray.util.get_node_ip_address()
        self.gpus = [str(g) for g in ray.get_runtime_context().get_accelerator_ids().get("GPU", [])]
        self.stopping = False
        self.proc: subprocess.Popen | None = None
        self.error = ""
        try:
            self.visible = actor_devices(self.gpus, gpus, placed, name)
        except ConfigError as exc:  # reported by info()/where(): the driver stops the run with it
            self.error, self.visible = str(exc), None
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        if start and not self.error:
            self.launch({})

    def launch(self, env: dict) -> int:
        """Start the role process (again), with `env` over the actor's own (a trainer rank's variables)."""
        me = os.getpid()
        devices = {} if self.visible is None else {"CUDA_VISIBLE_DEVICES": self.visible}
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, *self.argv], stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env={**os.environ, "PYTHONUNBUFFERED": "1", **devices, **self.env, **env}, start_new_session=True,
                cwd=self.cwd, preexec_fn=lambda: _die_with_parent(me))
        return self.proc.pid

    def where(self) -> dict:
        return {"node_id": self.node_id, "ip": self.ip, "gpus": self.gpus, "actor_pid": os.getpid(),
                "error": self.error}

    def info(self) -> dict:
        if self.error:
            return {"node_id": self.node_id, "ip": self.ip, "pid": None, "actor_pid": os.getpid(), "code": 2,
                    "reason": self.error, "error": self.error}
        code = self.proc.poll() if self.proc is not None else None
        return {"node_id": self.node_id, "ip": self.ip, "pid": self.proc.pid if self.proc else None,
                "actor_pid": os.getpid(), "code": code,
                "reason": describe_exit(code, self.log_path) if code is not None else None}

    def kill_process(self) -> None:
        """SIGKILL the role process and reap it (a trainer unit restarting)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def stop(self, grace_s: float) -> int | None:
        """SIGTERM (drain, checkpoint), SIGKILL after the grace period."""
        self.stopping = True
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        return self.proc.returncode


# ---------------------------------------------------------------- the driver
@dataclass
class RayChild(Child):
    options: dict = field(default_factory=dict)
    actor: Any = None
    pid: int | None = None  # the role process's pid as last seen
    node_id: str | None = None
    restarting: float | None = None  # when the driver killed the actor to restart it (monotonic)
    unavailable_since: float | None = None
    lost: str = ""  # why the actor was last unreachable
    died_once: bool = False  # one ActorDiedError seen (a second in a row: dead for good)


class RayLauncher(Launcher):
    """Launcher whose children are Ray actors (prepare: join Ray, place the anchors; then plan, start_all,
    check_children, stop_all as the local launcher)."""

    def __init__(self, cfg: Any, console: Any = None, ray: Any = None):
        cfg.run.run_dir = str(Path(cfg.run.run_dir).resolve())  # actors may start elsewhere (shared FS)
        super().__init__(cfg, console)
        self.ray = ray
        self.owns_ray = False
        self.cluster: dict[str, float] = {}
        self.anchors: dict[str, str] = {}  # role -> node id it is pinned to
        self.remote_cls: Any = None
        self.unit: TrainerUnit | None = None  # launcher.trainer_ranks > 1: the ranks as one unit (ray_unit.py)

    def prepare(self) -> Path:
        self.ray = self.ray or import_ray()
        check_ray_resources(self.cfg)
        ray, lc = self.ray, self.cfg.launcher
        if not ray.is_initialized():
            kwargs: dict = {"address": lc.ray_address, "log_to_driver": False}  # role logs: run_dir/logs
            if lc.ray_address is None and not os.environ.get("RAY_ADDRESS"):
                kwargs["include_dashboard"] = False  # a new local instance
            check_reachable(lc.ray_address)
            try:
                ray.init(**kwargs)
            except (ConnectionError, RuntimeError, ValueError) as exc:
                raise ConfigError(f"cannot join the Ray cluster at {lc.ray_address or os.environ.get('RAY_ADDRESS')}"
                                  f": {first_line(exc)} (--address HOST:PORT of a `ray start --head` node)") from None
            self.owns_ray = True
        self.cluster = ray.cluster_resources()
        check_gpu_demand(self.cfg, self.cluster, [n["Resources"] for n in ray.nodes() if n.get("Alive")])
        self.place_anchors()
        return super().prepare()

    def probe(self, role: str, node_id: str | None, cfg: Any = None) -> dict:
        ray = self.ray
        request = role_request(role, self.cfg, self.cluster)
        ref = ray.remote(probe_node).options(**ray_options(request, node_id), max_retries=0).remote(cfg)
        try:
            return ray.get(ref, timeout=PLACE_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError:
            ray.cancel(ref, force=True)
            raise ConfigError(f"no Ray node can take the {role} within {PLACE_TIMEOUT_S:.0f} s: it asks for "
                              f"{request}; the cluster offers {self.cluster} (launcher.ray_resources, "
                              "docs/many-hosts.md)") from None

    def place_anchors(self) -> None:
        """The brokers (and a zmq weight server) are addressed by IP in the config every actor reads: find
        their nodes and ports first, then pin them there."""
        cfg = self.cfg
        request = role_request("broker", cfg, self.cluster)
        home = None if is_custom("broker", cfg, request) else self.ray.get_runtime_context().get_node_id()
        where = self.probe("broker", home, cfg.model_copy(deep=True))
        self.anchors["broker"] = where["node_id"]
        cfg.brokers.host = where["ip"]
        for name, port in where["ports"].items():
            setattr(cfg.brokers, name, port)
        if cfg.launcher.trainer_ranks > 1:  # its bundles are held from now on; rank 0 serves zmq weights
            self.unit = TrainerUnit(self)
            ips = self.unit.reserve()
            if cfg.trainer.publish_mode == "zmq":
                cfg.trainer.weight_server_host = ips[0]
                if cfg.trainer.sharded_publish and len(set(ips)) > 1:  # every rank serves from its own node
                    cfg.trainer.weight_server_hosts = ips
        elif cfg.trainer.publish_mode == "zmq":
            trainer = self.probe("trainer", None)
            self.anchors["trainer"] = trainer["node_id"]
            cfg.trainer.weight_server_host = trainer["ip"]
        try:
            config_from_dict(cfg.model_dump(mode="json"), "backend ray")
        except ConfigError as exc:
            raise ConfigError(f"{exc}\n(backend ray: the brokers bind their node's IP {where['ip']}, so the run "
                              "needs its keys: drop --insecure / security.insecure)") from None

    def plan(self, config_path: Path) -> list[Child]:
        kids = super().plan(config_path)
        self.children = []
        for c in kids:
            if c.role == "trainer" and self.unit is not None:  # the ranks' actors are the unit's
                self.unit.args, self.unit.env = c.args[1:], c.env
                self.children.append(self.unit)
            else:
                self.children.append(RayChild(**vars(c), options=self.options_for(c.role)))
        return self.children

    def options_for(self, role: str) -> dict:
        request = role_request(role, self.cfg, self.cluster)
        node = self.anchors.get(role)
        if role == "controller" and not is_custom(role, self.cfg, request):
            node = self.anchors["broker"]
        return ray_options(request, node, spread=role in ("rollout", "reward"))

    # ------------------------------------------------------------ start
    def remote_class(self) -> Any:
        if self.remote_cls is None:
            self.remote_cls = self.ray.remote(RoleProcess)
        return self.remote_cls

    def start(self, child: Child) -> None:
        lc = self.cfg.launcher
        if isinstance(child, TrainerUnit):
            self.unit_call(child, child.start, "start")
            return
        gpus = child.options.get("num_gpus", 0)
        child.actor = self.remote_class().options(
            max_restarts=lc.max_restarts if lc.on_child_death == "restart" else 0, max_task_retries=0,
            **child.options).remote(child.name, child.role, child.args[1:], child.env, str(child.log_path),
                                    os.getcwd(), gpus, uses_placement(self.cfg))

    def start_all(self) -> None:
        from areal_mq.client import JobClient

        for child in self.children:
            self.start(child)
            if child.role == "broker":
                if not self.await_placement(child):
                    return
                probe = JobClient(self.cfg.brokers.job_addr, keys=self.keys)
                try:
                    probe.stats(timeout=30)
                finally:
                    probe.close()
            if self.failure:
                return
        for child in self.children[1:]:
            if not isinstance(child, TrainerUnit) and not self.await_placement(child):
                return

    def await_placement(self, child: RayChild) -> bool:
        try:
            info = self.ray.get(child.actor.info.remote(), timeout=PLACE_TIMEOUT_S)
            if info.get("error"):  # it was given other GPUs than it asked for
                self.failure = f"{child.name}: {info['error']}"
                return False
            self.observe(child, info)
            return True
        except self.ray.exceptions.GetTimeoutError:
            self.failure = (f"{child.name} could not be placed within {PLACE_TIMEOUT_S:.0f} s: it asks for "
                            f"{_shown(child.options)}; the cluster offers {self.cluster}")
        except self.ray.exceptions.RayActorError as exc:
            self.failure = f"{child.name}: its actor failed to start: {first_line(exc)}. Log: {child.log_path}"
        return False

    def observe(self, child: RayChild, info: dict) -> None:
        """A reply from the actor: note a new incarnation (restarted by Ray or by us) and where it runs."""
        child.unavailable_since, child.died_once = None, False
        if info["pid"] == child.pid:
            child.lost = ""
            return
        if child.pid is not None and child.restarting is None:  # Ray restarted a lost actor on its own
            child.restarts += 1
            reason = f"its actor on node {child.node_id} was lost ({child.lost or 'no reply'})"
            self.say(f"[yellow]{child.name}: {reason}; Ray restarted it on node {info['node_id'][:12]} "
                     f"({child.restarts}/{self.cfg.launcher.max_restarts}). Log: {child.log_path}[/]")
            self.event("launcher.child_restarted", child=child.name, role=child.role, pid=child.pid, reason=reason,
                       restarts=child.restarts, node_id=info["node_id"], from_node_id=child.node_id)
        child.restarting, child.lost = None, ""
        child.pid, child.node_id = info["pid"], info["node_id"]
        self.event("launcher.placed", level="info", child=child.name, role=child.role, node_id=info["node_id"],
                   node_ip=info["ip"], pid=info["pid"], actor_pid=info["actor_pid"], options=_shown(child.options))

    # ------------------------------------------------------------ supervision
    def check_children(self) -> str | None:
        """'done' when the trainer finished, 'failed' when the run must stop, else None (the local rules)."""
        if self.evaluator is not None and not self.stopping and (note := self.evaluator.poll()):
            self.say(note)
        if self.failure:
            return "failed"
        refs = [(c, None if isinstance(c, TrainerUnit) else c.actor.info.remote()) for c in self.children]
        for child, ref in refs:
            if isinstance(child, TrainerUnit):
                verdict = self.check_unit(child)
                if verdict is not None:
                    return verdict
                continue
            info = self.poll_one(child, ref)
            if info is None:
                if self.failure:
                    return "failed"
                continue
            code = info["code"]
            if child.restarting is not None:  # the old actor may answer until the kill lands
                if time.monotonic() - child.restarting > PLACE_TIMEOUT_S:
                    self.failure = f"{child.name} was not restarted within {PLACE_TIMEOUT_S:.0f} s"
                    return "failed"
                continue
            verdict = self.exit_verdict(child.role, code)
            if verdict == "done":
                return "done"
            if verdict == "ignore":
                continue
            if not self.restart(child, info["reason"]):
                return "failed"
        return None

    def check_unit(self, unit: TrainerUnit) -> str | None:
        """The trainer unit's verdict under the local rules: 'done', 'failed' or None (restarted or running)."""
        verdict, reason = unit.poll()
        if verdict == "done":
            return "done"
        if verdict is None or self.stopping:
            return None
        lc = self.cfg.launcher
        if lc.on_child_death == "restart" and unit.restarts < lc.max_restarts:
            self.say(f"[yellow]the trainer unit is down ({reason}); restarting all {unit.n} ranks "
                     f"({unit.restarts + 1}/{lc.max_restarts}). Logs: {unit.log_path.parent}[/]")
            self.event("launcher.child_restarted", child=unit.name, role=unit.role, reason=reason,
                       restarts=unit.restarts + 1, pids=unit.pids)
            self.unit_call(unit, unit.restart, "restart")
            return "failed" if self.failure else None
        self.failure = f"the trainer unit is down ({reason}). Logs: {unit.log_path.parent}"
        self.event("launcher.child_died", child=unit.name, role=unit.role, reason=reason)
        return "failed"

    def unit_call(self, unit: TrainerUnit, call: Any, what: str) -> None:
        """unit.start or unit.restart; whatever stops it (a GPU check, Ray's errors) stops the run by name."""
        try:
            call()
        except ConfigError as exc:
            self.failure = f"the trainer unit cannot {what}: {exc}"
        except Exception as exc:  # noqa: BLE001 - Ray's errors (actor lost, timeout, a task's exception)
            self.failure = f"the trainer unit cannot {what}: {first_line(exc)}. Logs: {unit.log_path.parent}"

    def poll_one(self, child: RayChild, ref: Any) -> dict | None:
        exc_mod = self.ray.exceptions
        try:
            info = self.ray.get(ref, timeout=CALL_TIMEOUT_S)
        except (exc_mod.RayActorError, exc_mod.GetTimeoutError) as exc:  # restarting, or being placed again
            child.lost = f"no reply in {CALL_TIMEOUT_S:.0f} s" if isinstance(exc, exc_mod.GetTimeoutError) else \
                f"{type(exc).__name__}: {first_line(exc)}"
            child.unavailable_since = child.unavailable_since or time.monotonic()
            if isinstance(exc, exc_mod.ActorDiedError):  # the call's actor died: for good if the next call's too
                if child.died_once and child.restarting is None:
                    self.failure = (f"{child.name}: its Ray actor is dead ({child.restarts}/"
                                    f"{self.cfg.launcher.max_restarts} restarts used): {child.lost}. "
                                    f"Log: {child.log_path}")
                    self.event("launcher.child_died", child=child.name, role=child.role, reason=child.lost)
                    return None
                child.died_once = True
            else:
                child.died_once = False
            if time.monotonic() - child.unavailable_since > PLACE_TIMEOUT_S:
                self.failure = (f"{child.name} unreachable for {PLACE_TIMEOUT_S:.0f} s ({child.lost or 'no reply'}); "
                                f"it asks for {_shown(child.options)}; the cluster offers "
                                f"{self.ray.available_resources()}")
            return None
        self.observe(child, info)
        return info

    def restart(self, child: RayChild, reason: str) -> bool:
        """The local launcher's rule for a dead role process; the restart itself is Ray's (actor killed with
        restart allowed: the new actor's constructor starts the role)."""
        lc = self.cfg.launcher
        if lc.on_child_death == "restart" and child.restarts < lc.max_restarts:
            child.restarts += 1
            self.say(f"[yellow]{child.name} died ({reason}); restarting ({child.restarts}/{lc.max_restarts}). "
                     f"Log: {child.log_path}[/]")
            self.event("launcher.child_restarted", child=child.name, role=child.role, pid=child.pid, reason=reason,
                       restarts=child.restarts)
            child.restarting = time.monotonic()
            self.ray.kill(child.actor, no_restart=False)
            return True
        self.failure = f"{child.name} died ({reason}). Log: {child.log_path}"
        self.event("launcher.child_died", child=child.name, role=child.role, reason=reason)
        return False

    def stop_all(self, grace_s: float | None = None) -> None:
        """Workers first (SIGTERM: drain and checkpoint), the brokers last; then the actors, then Ray. The grace
        is the local launcher's (launcher.stop_grace_s, else sized by the trainer's checkpoint)."""
        grace_s = default_stop_grace_s(self.cfg) if grace_s is None else grace_s
        self.stopping = True
        ray = self.ray
        placed = [c for c in self.children if not isinstance(c, TrainerUnit) and c.actor is not None]
        workers, brokers = [c for c in placed if c.role != "broker"], [c for c in placed if c.role == "broker"]
        for group in (workers, brokers):
            refs = [c.actor.stop.remote(grace_s) for c in group]
            if self.unit is not None and group is workers:
                self.unit.stop(grace_s)  # beside the other workers, before the brokers
            for ref in refs:
                try:
                    ray.get(ref, timeout=grace_s + 10)
                except Exception:  # noqa: BLE001 - a lost or restarting actor: its role died with it
                    pass
        for c in placed:
            ray.kill(c.actor, no_restart=True)
        if self.unit is not None:
            self.unit.release()
        if self.owns_ray:
            ray.shutdown()


def _shown(options: dict) -> dict:
    """Options as plain data (for events and messages): a strategy object becomes its node id or name."""
    out = {k: v for k, v in options.items() if k != "scheduling_strategy"}
    strategy = options.get("scheduling_strategy")
    if strategy is not None:
        out["scheduling"] = strategy if isinstance(strategy, str) else f"node {getattr(strategy, 'node_id', '?')}"
    return out
