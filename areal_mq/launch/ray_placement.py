"""What each Ray actor of a run asks for, and what each role process is told about its devices and its ranks.

Pure rules (no Ray import), so tests check them without a cluster; areal_mq/launch/ray_backend.py and
ray_unit.py apply them.

Resources of one actor (a trainer rank's bundle is the same request):

    broker      areal_brokers, else the driver's node
    controller  areal_controller, else the brokers' node
    trainer     areal_trainer, else one GPU per rank when the cluster has a GPU for each, else
                num_cpus = launcher.threads.trainer
    rollout     areal_rollout, else num_cpus = launcher.threads.rollout (default 1)
    reward      areal_reward, else no resources

`launcher.ray_resources.ROLE` replaces a role's default; `placement.ROLE.gpus_per_process: N` adds N GPUs each
(Ray picks which). Devices: an actor given GPUs passes exactly those to its role process as
CUDA_VISIBLE_DEVICES (checked: as many as asked, none twice on a node); once any role asks for GPUs, a role
that asked for none gets an empty CUDA_VISIBLE_DEVICES, as under the local launcher (launcher.py).
A trainer of several ranks is one unit: each rank on a node sees the GPUs of all the unit's ranks there (NCCL
wants its peers visible) and takes the one at its LOCAL_RANK; the ranks meet at MASTER_ADDR = brokers.host,
where ray_unit.py keeps a rendezvous store (torch's agent-store mode, a new store for each start of the unit).
"""
from __future__ import annotations

from typing import Any

from areal_mq.errors import ConfigError

ROLES = ("broker", "controller", "trainer", "rollout", "reward")
TINY_CPU = 0.001  # a bundle must hold something: a trainer rank asking for nothing holds this much CPU


def check_ray_resources(cfg: Any) -> None:
    unknown = sorted(set(cfg.launcher.ray_resources) - set(ROLES))
    if unknown:
        raise ConfigError(f"launcher.ray_resources: unknown role(s) {', '.join(unknown)}; roles: {', '.join(ROLES)}")


def placement_gpus(cfg: Any, role: str) -> int | None:
    """placement.ROLE.gpus_per_process (N GPUs each under Ray), None where the role names none."""
    place = getattr(cfg.placement, role, None)
    return None if place is None else place.gpus_per_process


def uses_placement(cfg: Any) -> bool:
    return any(placement_gpus(cfg, r) for r in ("trainer", "rollout", "reward", "agent"))


def role_request(role: str, cfg: Any, cluster: dict[str, float]) -> dict:
    """Resources of one actor of `role` (one trainer rank), before pinning to a node (the module docstring)."""
    lc = cfg.launcher
    gpus = placement_gpus(cfg, role)
    if role in lc.ray_resources:
        res = dict(lc.ray_resources[role])
        out = {"num_cpus": res.pop("num_cpus", 0), "num_gpus": res.pop("num_gpus", 0), "resources": res}
    elif (own := "areal_brokers" if role == "broker" else f"areal_{role}") in cluster:
        out = {"num_cpus": 0, "num_gpus": 0, "resources": {own: 1}}
    elif role == "trainer" and gpus is None and cluster.get("GPU", 0) >= lc.trainer_ranks:
        out = {"num_cpus": 0, "num_gpus": 1, "resources": {}}
    else:
        cpus = lc.threads.get(role, 1) if role in ("trainer", "rollout") else 0
        out = {"num_cpus": cpus, "num_gpus": 0, "resources": {}}
    if gpus:
        if out["num_gpus"] not in (0, gpus):
            raise ConfigError(f"launcher.ray_resources.{role}.num_gpus ({out['num_gpus']}) and "
                              f"placement.{role}.gpus_per_process ({gpus}) disagree; name the GPUs in one place")
        out["num_gpus"] = gpus
    return out


def is_custom(role: str, cfg: Any, request: dict) -> bool:
    """True when the role's placement was asked for (ray_resources or an areal_* resource), not defaulted."""
    return role in cfg.launcher.ray_resources or bool(request["resources"])


def trainer_bundle(cfg: Any, cluster: dict[str, float]) -> dict:
    """The placement-group bundle of one trainer rank (Ray's resource names)."""
    req = role_request("trainer", cfg, cluster)
    bundle = {k: v for k, v in {"CPU": req["num_cpus"], "GPU": req["num_gpus"], **req["resources"]}.items() if v}
    return bundle or {"CPU": TINY_CPU}


def check_gpu_demand(cfg: Any, cluster: dict[str, float], nodes: list[dict[str, float]]) -> None:
    """Refuse, before anything starts, GPUs the cluster cannot give: in all, per process, and for a trainer
    packed on one node. `nodes`: the resources of each alive node."""
    lc = cfg.launcher
    counts = {"trainer": lc.trainer_ranks, "rollout": lc.rollout_workers, "reward": lc.reward_workers}
    if cfg.agent.workflow:
        counts["agent"] = lc.agent_workers
    asks = {r: (n, role_request(r, cfg, cluster)["num_gpus"]) for r, n in counts.items()}
    asks = {r: (n, g) for r, (n, g) in asks.items() if g}
    total, offered = sum(n * g for n, g in asks.values()), cluster.get("GPU", 0)
    shown = ", ".join(f"{r} {n} x {g:g}" for r, (n, g) in asks.items())
    if total > offered:
        raise ConfigError(f"the run asks Ray for {total:g} GPUs ({shown}) but the cluster offers {offered:g}; "
                          "lower placement.ROLE.gpus_per_process or the process counts (launcher.*), or add nodes")
    biggest = max((n.get("GPU", 0) for n in nodes), default=0)
    for role, (n, g) in asks.items():
        if g > biggest:
            raise ConfigError(f"placement.{role}: one {role} process asks for {g:g} GPUs but the largest node offers "
                              f"{biggest:g}; a process cannot span nodes")
    n, g = asks.get("trainer", (lc.trainer_ranks, 0))
    if g and n > 1 and lc.ray_trainer_strategy == "STRICT_PACK" and n * g > biggest:
        raise ConfigError(f"the trainer's {n} ranks x {g:g} GPU are packed on one node (launcher.ray_trainer_strategy"
                          f" STRICT_PACK) but the largest node offers {biggest:g} GPUs; use PACK to span nodes")


def actor_devices(gpu_ids: list[str], asked: float, placed: bool, name: str) -> str | None:
    """CUDA_VISIBLE_DEVICES for the role process of an actor Ray gave `gpu_ids`: those (checked against what
    the actor asked for), "" when the run places GPUs and this one asked for none, None to leave it alone."""
    if asked and len(gpu_ids) != int(asked):
        raise ConfigError(f"{name} asked Ray for {asked:g} GPU(s) and was given {len(gpu_ids)} ({gpu_ids}): "
                          "ask for whole GPUs (placement.ROLE.gpus_per_process)")
    if len(set(gpu_ids)) != len(gpu_ids):
        raise ConfigError(f"{name} was given GPU(s) {sorted({g for g in gpu_ids if gpu_ids.count(g) > 1})} twice")
    if gpu_ids:
        return ",".join(gpu_ids)
    return "" if placed else None


def rank_envs(where: list[dict], master_addr: str, master_port: int, attempt: int, placed: bool) -> list[dict]:
    """The environment of each trainer rank, `where[i]` = {"node_id", "gpus": [ids Ray gave rank i]}: torch's
    rank variables, the rendezvous (every rank a client of the store at master_addr:master_port), and the
    unit's GPUs on the rank's node, in local-rank order. ConfigError names a GPU given to two ranks."""
    nodes: list[str] = []
    for w in where:
        if w["node_id"] not in nodes:
            nodes.append(w["node_id"])
    local = {n: [i for i, w in enumerate(where) if w["node_id"] == n] for n in nodes}
    envs = []
    for rank, w in enumerate(where):
        mates = local[w["node_id"]]
        gpus = [g for i in mates for g in where[i]["gpus"]]
        twice = sorted({g for g in gpus if gpus.count(g) > 1})
        if twice:
            raise ConfigError(f"trainer ranks {mates} on node {w['node_id'][:12]} were given GPU(s) {twice} twice "
                              f"({[where[i]['gpus'] for i in mates]})")
        env = {"RANK": str(rank), "WORLD_SIZE": str(len(where)), "LOCAL_RANK": str(mates.index(rank)),
               "LOCAL_WORLD_SIZE": str(len(mates)), "GROUP_RANK": str(nodes.index(w["node_id"])),
               "MASTER_ADDR": master_addr, "MASTER_PORT": str(master_port),
               "TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RESTART_COUNT": str(attempt)}
        if gpus or placed:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)
        envs.append(env)
    return envs
