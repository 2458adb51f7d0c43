"""A trainer of several ranks (launcher.trainer_ranks > 1) under `areal-mq run --backend ray`: one unit.

What: a Ray placement group with one bundle per rank (launcher.ray_trainer_strategy, STRICT_PACK by default:
all ranks on one node), one `RoleProcess` actor per bundle, each owning one rank's process (`areal-mq worker
trainer`, the same command a rank runs under torch.distributed.run), and a rendezvous store on the brokers'
node (`Rendezvous`) where the ranks meet: MASTER_ADDR = brokers.host, so ranks on several nodes find it.
Why not torchrun inside one actor: a unit spanning nodes has no one host to run it on, and each rank should
hold exactly its own bundle's GPU. The unit does torchrun's part itself:

    reserve()   the placement group, in the driver's prepare, and each bundle's node IP (rank 0's is the zmq
                weight server; with sharded publishing over several nodes every rank serves its shards from its
                own node's IP: trainer.weight_server_hosts)
    start()     actors into their bundles -> where each landed and which GPUs Ray gave it -> a new store
                (a new port) -> each rank's environment (ray_placement.rank_envs) -> every rank process starts
    poll()      rank 0 exits 0: the run is done; any rank exits non-zero or its actor is lost: the unit is dead
    restart()   every rank process killed (a rank alone cannot go on: its peers' collectives hang), lost actors
                made again in their bundles (Ray moves a bundle whose node is gone), then start() again: the
                ranks resume from their last sharded checkpoint, as after a torchrun restart
    stop()      SIGTERM to every rank at once (they checkpoint together), SIGKILL after the grace

Invariant: at most one incarnation of the unit runs: a new start happens only after every old rank process
is known dead (killed by its actor, or gone with its actor).
The store is torch's TCPStore (every rank a client: TORCHELASTIC_USE_AGENT_STORE), unauthenticated like
torchrun's; it lives only on the brokers' node.
"""
from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from areal_mq.errors import ConfigError
from areal_mq.launch.ray_probe import first_line, probe_node
from areal_mq.launch.ray_placement import rank_envs, role_request, trainer_bundle, uses_placement

PLACE_TIMEOUT_S = 300.0
CALL_TIMEOUT_S = 5.0


class Rendezvous:
    """Ray actor on the brokers' node: a fresh TCPStore for each start of the trainer unit (torchrun makes a
    new store per retry too; a restarted unit must not read the dead one's keys)."""

    def __init__(self):
        self.stores: list[Any] = []  # kept: a store's clients may still be closing

    def open(self) -> int:
        from torch.distributed import TCPStore

        store = TCPStore("0.0.0.0", 0, is_master=True, wait_for_workers=False)
        self.stores = [*self.stores[-1:], store]
        return store.port


class TrainerUnit:
    """The trainer's ranks as one child of RayLauncher (name, role, log_path, restarts like a Child)."""

    name = "trainer"
    role = "trainer"

    def __init__(self, launcher: Any, args: list[str] | None = None, env: dict[str, str] | None = None):
        self.launcher, self.args, self.env = launcher, args or [], env or {}  # args, env: set by RayLauncher.plan
        self.cfg, self.ray = launcher.cfg, launcher.ray
        self.n = self.cfg.launcher.trainer_ranks
        self.restarts = 0
        self.attempt = -1
        self.pg: Any = None
        self.store: Any = None
        self.actors: list[Any] = [None] * self.n
        self.pids: list[int | None] = [None] * self.n
        self.where: list[dict] = []
        self.request = role_request("trainer", self.cfg, launcher.cluster)
        self.bundle = trainer_bundle(self.cfg, launcher.cluster)
        self.unavailable_since: float | None = None

    def rank_name(self, i: int) -> str:
        return f"trainer-rank{i}"

    @property
    def log_path(self) -> Path:
        return Path(self.cfg.run.run_dir) / "logs" / f"{self.rank_name(0)}.log"

    def bundle_options(self, i: int) -> dict:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        return {**self.request, "scheduling_strategy": PlacementGroupSchedulingStrategy(
            self.pg, placement_group_bundle_index=i, placement_group_capture_child_tasks=False)}

    # ------------------------------------------------------------ placement
    def reserve(self) -> list[str]:
        """Make the placement group and wait until Ray holds every bundle; returns each rank's node IP, in rank
        order (a probe in every bundle)."""
        from ray.util.placement_group import placement_group


        strategy = self.cfg.launcher.ray_trainer_strategy
        self.pg = placement_group([dict(self.bundle) for _ in range(self.n)], strategy=strategy,
                                  name=f"areal-trainer-{os.getpid()}-{time.time_ns()}")
        try:
            self.ray.get(self.pg.ready(), timeout=PLACE_TIMEOUT_S)
        except self.ray.exceptions.GetTimeoutError:
            raise ConfigError(f"Ray could not reserve the trainer's {self.n} bundles of {self.bundle} ({strategy}) "
                              f"within {PLACE_TIMEOUT_S:.0f} s; the cluster offers {self.launcher.cluster} "
                              "(launcher.ray_trainer_strategy, placement.trainer, docs/many-hosts.md)") from None
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        probes = [self.ray.remote(probe_node).options(num_cpus=0, max_retries=0, scheduling_strategy=
                                                      PlacementGroupSchedulingStrategy(self.pg, i)).remote()
                  for i in range(self.n)]
        return [w["ip"] for w in self.ray.get(probes, timeout=PLACE_TIMEOUT_S)]

    # ------------------------------------------------------------ start
    def start(self) -> None:
        """Actors into their bundles (those missing), a new store, then every rank process (module docstring)."""
        ray, lc = self.ray, self.cfg.launcher
        self.attempt += 1
        if self.store is None:
            from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

            self.store = ray.remote(Rendezvous).options(num_cpus=0, max_restarts=-1, scheduling_strategy=
                                                        NodeAffinitySchedulingStrategy(
                                                            self.launcher.anchors["broker"], soft=False)).remote()
        cls = self.launcher.remote_class()
        placed = uses_placement(self.cfg)
        run_dir = Path(self.cfg.run.run_dir)
        for i, actor in enumerate(self.actors):
            if actor is None:
                self.actors[i] = cls.options(max_restarts=0, max_task_retries=0, **self.bundle_options(i)).remote(
                    self.rank_name(i), "trainer", self.args, self.env,
                    str(run_dir / "logs" / f"{self.rank_name(i)}.log"), os.getcwd(), self.request["num_gpus"], placed,
                    False)
        self.where = ray.get([a.where.remote() for a in self.actors], timeout=PLACE_TIMEOUT_S)
        errors = [w["error"] for w in self.where if w.get("error")]
        if errors:
            raise ConfigError("; ".join(errors))
        port = ray.get(self.store.open.remote(), timeout=PLACE_TIMEOUT_S)
        envs = rank_envs(self.where, self.cfg.brokers.host, port, self.attempt, placed)
        self.pids = ray.get([a.launch.remote(env) for a, env in zip(self.actors, envs)], timeout=PLACE_TIMEOUT_S)
        for i, (w, env, pid) in enumerate(zip(self.where, envs, self.pids)):
            self.launcher.event("launcher.placed", level="info", child=self.rank_name(i), role="trainer",
                                node_id=w["node_id"], node_ip=w["ip"], pid=pid, actor_pid=w["actor_pid"],
                                gpus=w["gpus"], rank=i, attempt=self.attempt, master=f"{env['MASTER_ADDR']}:{port}",
                                cuda_visible_devices=env.get("CUDA_VISIBLE_DEVICES"), bundle=self.bundle,
                                strategy=lc.ray_trainer_strategy)

    # ------------------------------------------------------------ supervision
    def poll(self) -> tuple[str | None, str]:
        """('done', '') when rank 0 finished the run, ('dead', why) when the unit must restart or stop (every
        rank found dead is named: the one killed and the peers its death took down), else (None, '')."""

        exc = self.ray.exceptions
        if any(a is None for a in self.actors):
            return "dead", "a rank's actor is missing"
        refs = [a.info.remote() for a in self.actors]
        dead, late = [], None
        for i, ref in enumerate(refs):
            try:
                info = self.ray.get(ref, timeout=CALL_TIMEOUT_S)
            except exc.RayActorError as e:
                self.actors[i] = None  # gone with its node or its Ray worker: made again at the next start
                dead.append(f"{self.rank_name(i)}'s actor was lost ({first_line(e)})")
                continue
            except exc.GetTimeoutError:
                late = i
                continue
            code = info["code"]
            if i == 0 and code == 0:
                return "done", ""
            if code not in (None, 0):
                dead.append(f"{self.rank_name(i)} (pid {info['pid']}) {info['reason']}")
        if dead:
            return "dead", "; ".join(dead)
        if late is not None:
            self.unavailable_since = self.unavailable_since or time.monotonic()
            if time.monotonic() - self.unavailable_since > PLACE_TIMEOUT_S:
                return "dead", f"{self.rank_name(late)} did not answer for {PLACE_TIMEOUT_S:.0f} s"
            return None, ""
        self.unavailable_since = None
        return None, ""

    def restart(self) -> None:
        """Every old rank process dead (or its actor gone), then a new start in the same bundles."""
        self.restarts += 1
        for i, actor in enumerate(self.actors):
            if actor is None:
                continue
            try:
                self.ray.get(actor.kill_process.remote(), timeout=30)
            except (self.ray.exceptions.RayActorError, self.ray.exceptions.GetTimeoutError):
                self.ray.kill(actor, no_restart=True)  # its process dies with it (PR_SET_PDEATHSIG)
                self.actors[i] = None
        self.start()

    def stop(self, grace_s: float) -> None:
        """SIGTERM to every rank at once (a sharded checkpoint needs them all), SIGKILL after the grace."""
        refs = [a.stop.remote(grace_s) for a in self.actors if a is not None]
        for ref in refs:
            try:
                self.ray.get(ref, timeout=grace_s + 10)
            except Exception:  # noqa: BLE001 - a lost actor: its rank died with it
                pass

    def release(self) -> None:
        from ray.util.placement_group import remove_placement_group

        for actor in [*self.actors, self.store]:
            if actor is not None:
                self.ray.kill(actor, no_restart=True)
        if self.pg is not None:
            remove_placement_group(self.pg)

