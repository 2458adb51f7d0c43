"""`areal-mq run --backend ray`: roles as Ray actors placed by resources, a lost node survived.

The fast tests need no Ray: a missing Ray is a ConfigError naming the extra, the local launcher stays the
default, the placement table (areal_ROLE resources, GPU, launcher.ray_resources) is pure logic, and the
driver's restart rules run against a scripted Ray (replies and errors of `RoleProcess.info`).
The slow test starts a Ray cluster of four logical nodes on this machine (ray.cluster_utils.Cluster), each
with its own resources, runs configs/tiny.yaml on it with `areal-mq run --backend ray --address`, checks
where each role's actor landed (the launcher's `launcher.placed` events name the node), removes the rollout
worker's node after the first training step while killing the trainer's process (kill -9), and checks the
run still reaches total_steps: the rollout actor restarted on the other rollout node, the trainer's actor
restarted in place, the lost rollout process gone with its actor.

Run: pytest tests/integration/test_ray_backend.py -q -m slow -s   (~2 min on a 2-core machine)
"""
from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import pytest

from areal_mq.config import load_config
from areal_mq.errors import ConfigError
from areal_mq.launch.ray_backend import check_ray_resources, role_request

from .procs import free_ports, wait_for
from .test_chaos import _events

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs" / "tiny.yaml"
STEPS = 30  # the node goes at the first step; the rest needs the restarted rollout worker


# ---------------------------------------------------------------- without Ray
def _run_cli(args: list[str]):
    import typer
    from typer.testing import CliRunner

    from areal_mq.launch import cli as launch_cli

    app = typer.Typer()
    launch_cli.register(app)
    return CliRunner().invoke(app, args)


def test_missing_ray_is_a_config_error_naming_the_extra(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError, as where it is not installed
    result = _run_cli(["run", str(TINY), "--backend", "ray", "--skip-eval", "--set", f"run.run_dir={tmp_path / 'r'}"])
    assert result.exit_code == 2, result.output
    assert "pip install -e .[ray]" in result.output
    assert not (tmp_path / "r").exists()  # refused before anything was made


def test_an_address_nobody_listens_on_is_refused_at_once(tmp_path):
    pytest.importorskip("ray")
    port = free_ports(1)[0]
    result = _run_cli(["run", str(TINY), "--backend", "ray", "--address", f"127.0.0.1:{port}", "--skip-eval",
                       "--set", f"run.run_dir={tmp_path / 'r'}"])
    assert result.exit_code == 2 and "cannot join the Ray cluster" in result.output, result.output


def test_backend_is_local_by_default_and_checked():
    assert load_config(TINY).launcher.backend == "local"
    assert load_config(TINY, ["launcher.backend=ray"]).launcher.backend == "ray"
    with pytest.raises(ConfigError, match="launcher.backend"):
        load_config(TINY, ["launcher.backend=k8s"])


def test_placement_table():
    cfg = load_config(TINY)  # launcher.threads: {rollout: 1, trainer: 1}
    labelled = {"CPU": 4, "areal_brokers": 1, "areal_trainer": 1, "areal_rollout": 2, "areal_reward": 1}
    for role, res in (("broker", "areal_brokers"), ("trainer", "areal_trainer"), ("rollout", "areal_rollout")):
        assert role_request(role, cfg, labelled) == {"num_cpus": 0, "num_gpus": 0, "resources": {res: 1}}
    plain = {"CPU": 4}
    assert role_request("trainer", cfg, {**plain, "GPU": 2})["num_gpus"] == 1
    assert role_request("trainer", cfg, plain) == {"num_cpus": 1, "num_gpus": 0, "resources": {}}
    assert role_request("reward", cfg, plain) == {"num_cpus": 0, "num_gpus": 0, "resources": {}}
    cfg = load_config(TINY, ["launcher.ray_resources={trainer: {num_gpus: 1, big: 1}}"])
    assert role_request("trainer", cfg, labelled) == {"num_cpus": 0, "num_gpus": 1, "resources": {"big": 1}}
    with pytest.raises(ConfigError, match="trainers"):
        check_ray_resources(load_config(TINY, ["launcher.ray_resources={trainers: {num_cpus: 1}}"]))


# ---------------------------------------------------------------- the driver's rules, with a scripted Ray
class _Died(Exception):
    pass


class FakeRay:
    """What RayLauncher's supervision calls: get (a ref is a scripted reply or exception), kill, exceptions."""

    class exceptions:  # noqa: N801 - the shape of ray.exceptions
        class RayActorError(Exception):
            pass

        class ActorDiedError(RayActorError):
            pass

        class GetTimeoutError(Exception):
            pass

    def __init__(self):
        self.killed: list[tuple[str, bool]] = []

    def get(self, ref, timeout=None):
        if isinstance(ref, Exception):
            raise ref
        return ref

    def kill(self, actor, no_restart=True):
        self.killed.append((actor.name, no_restart))

    def available_resources(self):
        return {}


class FakeActor:
    def __init__(self, name: str, replies: list):
        self.name, self.replies = name, replies
        self.info = self

    def remote(self):
        return self.replies.pop(0) if len(self.replies) > 1 else self.replies[0]


def _reply(pid: int, code=None, node="n1") -> dict:
    return {"node_id": node, "ip": "10.0.0.1", "pid": pid, "actor_pid": pid + 1000, "code": code,
            "reason": None if code is None else f"exit code {code}"}


def _launcher(tmp_path, replies: dict[str, list], sets=()):
    from areal_mq.launch.ray_backend import RayChild, RayLauncher

    cfg = load_config(TINY, [f"run.run_dir={tmp_path / 'run'}", *sets])
    ray = FakeRay()
    launcher = RayLauncher(cfg, ray=ray)
    launcher.children = [RayChild(name, name.split("-")[0], [], tmp_path / f"{name}.log", actor=FakeActor(name, r))
                         for name, r in replies.items()]
    return launcher, ray


def test_a_dead_role_is_restarted_once_through_ray(tmp_path):
    died = FakeRay.exceptions.ActorDiedError("killed")
    launcher, ray = _launcher(tmp_path, {"rollout-0": [_reply(1), _reply(1, code=-9), _reply(1, code=-9), died,
                                                       _reply(2, node="n2")],
                                        "trainer": [*[_reply(5)] * 5, _reply(5, code=0)]},
                              ["launcher.on_child_death=restart", "launcher.max_restarts=1"])
    assert [launcher.check_children() for _ in range(5)] == [None] * 5
    assert ray.killed == [("rollout-0", False)]  # restart allowed; the old actor's second answer is no new death
    child = launcher.children[0]
    assert (child.restarts, child.pid, child.node_id, child.restarting) == (1, 2, "n2", None)
    assert launcher.check_children() == "done"
    assert [r["child"] for r in _events(tmp_path / "run", "launcher.child_restarted")] == ["rollout-0"]


def test_stop_mode_and_a_dead_actor_stop_the_run(tmp_path):
    launcher, _ = _launcher(tmp_path, {"reward-0": [_reply(1), _reply(1, code=3)]})  # tiny: on_child_death stop
    assert launcher.check_children() is None
    assert launcher.check_children() == "failed" and "exit code 3" in launcher.failure
    died = FakeRay.exceptions.ActorDiedError("the actor died")
    launcher, _ = _launcher(tmp_path, {"rollout-0": [_reply(1), died, died]})
    assert [launcher.check_children() for _ in range(3)] == [None, None, "failed"]  # one error may be a restart
    assert "is dead" in launcher.failure


# ---------------------------------------------------------------- on a Ray cluster
def _placed(run_dir: Path, key: str = "node_id") -> dict[str, str]:
    """child -> node id (or `key`: pid, the role process) of its latest placement."""
    if not (run_dir / "events").exists():
        return {}
    return {r["child"]: r.get(key) for r in _events(run_dir, "launcher.placed")}


def _gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/status").read_text().split("State:")[1].split()[0] in ("Z", "X")
    except (OSError, IndexError):
        return True


def _versions(run_dir: Path) -> list[int]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line)["version"] for line in path.read_text().splitlines() if line.strip().endswith("}")]


@pytest.fixture
def cluster():
    pytest.importorskip("ray")
    from ray.cluster_utils import Cluster

    c = Cluster(initialize_head=True, connect=False,
                head_node_args={"num_cpus": 1, "resources": {"areal_brokers": 1}})
    try:
        nodes = {"head": c.head_node,
                 "trainer": c.add_node(num_cpus=1, resources={"areal_trainer": 1}),
                 "rollout_a": c.add_node(num_cpus=1, resources={"areal_rollout": 1, "areal_reward": 1}),
                 "rollout_b": c.add_node(num_cpus=1, resources={"areal_rollout": 1, "areal_reward": 1})}
        c.wait_for_nodes()
        yield c, nodes
    finally:
        c.shutdown()


@pytest.mark.slow
@pytest.mark.long  # ~2 min: a 4-node local Ray cluster, a node removed mid-run (tests/README.md)
@pytest.mark.timeout(420)
def test_roles_placed_by_resources_and_a_lost_rollout_node_survived(cluster, procs, tmp_path):
    c, nodes = cluster
    ids = {name: node.node_id for name, node in nodes.items()}
    run_dir = tmp_path / "run"
    job, bus_in, bus_out, store = free_ports(4)
    sets = [f"run.run_dir={run_dir}", f"brokers.job_port={job}", f"brokers.bus_in_port={bus_in}",
            f"brokers.bus_out_port={bus_out}", f"brokers.store_port={store}", "brokers.heartbeat_s=0.5",
            "brokers.liveness=4", "brokers.reconnect_max_s=2", f"controller.total_steps={STEPS}",
            "launcher.on_child_death=restart", "launcher.max_restarts=3", "events.console=json"]
    driver = procs.start(["run", str(TINY), "--backend", "ray", "--address", c.address, "--skip-eval", "--quiet",
                          *[x for s in sets for x in ("--set", s)]], "driver")

    placed = wait_for(lambda: (p := _placed(run_dir)) and len(p) == 5 and p, 180, interval=0.5,
                      what=f"five placed actors ({procs.log(driver)[-2000:]})")
    assert placed["broker"] == placed["controller"] == ids["head"]  # areal_brokers; the controller beside them
    assert placed["trainer"] == ids["trainer"]
    assert placed["rollout-0"] in (ids["rollout_a"], ids["rollout_b"])
    assert placed["reward-0"] in (ids["rollout_a"], ids["rollout_b"])
    brokers_host = load_config(run_dir / "config.yaml").brokers.host
    assert brokers_host == nodes["head"].node_ip_address  # discovered from the brokers' node, not loopback

    wait_for(lambda: _versions(run_dir), 180, interval=0.2, what="the first training step")
    victim = "rollout_a" if placed["rollout-0"] == ids["rollout_a"] else "rollout_b"
    other = "rollout_b" if victim == "rollout_a" else "rollout_a"
    assert max(_versions(run_dir)) < STEPS - 2, "the run got too far before the node was removed"
    old = _placed(run_dir, "pid")
    os.kill(old["trainer"], signal.SIGKILL)  # a role process dies: the driver has Ray restart its actor
    c.remove_node(nodes[victim])  # a node is lost: Ray restarts its actors elsewhere

    assert driver.wait(300) == 0, procs.log(driver)[-3000:]
    assert max(_versions(run_dir)) == STEPS
    restarted = [r for r in _events(run_dir, "launcher.child_restarted") if r["child"] == "rollout-0"]
    assert restarted and restarted[0]["node_id"] == ids[other], restarted
    assert _placed(run_dir)["rollout-0"] == ids[other]
    trainer = [r for r in _events(run_dir, "launcher.child_restarted") if r["child"] == "trainer"]
    assert trainer and "SIGKILL" in trainer[0]["reason"], trainer
    assert _placed(run_dir)["trainer"] == ids["trainer"] and _placed(run_dir, "pid")["trainer"] != old["trainer"]
    wait_for(lambda: _gone(old["rollout-0"]), 10, what="the lost rollout process to be gone")  # died with its actor


# ---------------------------------------------------------------- a trainer unit and GPUs by placement
@pytest.fixture
def gpu_cluster():
    """The brokers' node, and two nodes of two (pretend) GPUs each: Ray hands out GPU ids whether or not a
    GPU is there, which is all placement needs; every process here runs on the CPU."""
    pytest.importorskip("ray")
    from ray.cluster_utils import Cluster

    c = Cluster(initialize_head=True, connect=False,
                head_node_args={"num_cpus": 1, "resources": {"areal_brokers": 1}})
    try:
        nodes = {"head": c.head_node, "a": c.add_node(num_cpus=2, num_gpus=2), "b": c.add_node(num_cpus=2, num_gpus=2)}
        c.wait_for_nodes()
        yield c, nodes
    finally:
        c.shutdown()


def _environ(pid: int) -> dict[str, str]:
    items = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode(errors="replace").split("=", 1) for item in items if b"=" in item)


UNIT_STEPS = 10


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_two_rank_trainer_unit_and_gpus_by_placement_under_ray(gpu_cluster, procs, tmp_path):
    """launcher.trainer_ranks 2 (fsdp over gloo) in a STRICT_PACK placement group of a GPU per rank, two rollout
    workers of a GPU each: each process's environment holds exactly the GPUs Ray gave it, the ranks meet at the
    brokers' host; kill -9 of rank 1 restarts the unit from its sharded checkpoint and the run ends with the
    chaos audit clean (nothing trained twice, nothing acked the final policy never saw)."""
    from .test_chaos import _audit

    c, nodes = gpu_cluster
    ids = {name: node.node_id for name, node in nodes.items()}
    run_dir = tmp_path / "run"
    job, bus_in, bus_out, store = free_ports(4)
    sets = [f"run.run_dir={run_dir}", f"brokers.job_port={job}", f"brokers.bus_in_port={bus_in}",
            f"brokers.bus_out_port={bus_out}", f"brokers.store_port={store}", "brokers.heartbeat_s=0.5",
            "brokers.liveness=4", "brokers.reconnect_max_s=2", f"controller.total_steps={UNIT_STEPS}",
            "launcher.on_child_death=restart", "launcher.max_restarts=2", "events.console=json",
            "trainer.strategy=fsdp", "trainer.checkpoint_every=2", "launcher.trainer_ranks=2",
            "launcher.rollout_workers=2", "placement.trainer.gpus_per_process=1",
            "placement.rollout.gpus_per_process=1"]
    driver = procs.start(["run", str(TINY), "--backend", "ray", "--address", c.address, "--skip-eval", "--quiet",
                          *[x for s in sets for x in ("--set", s)]], "driver")
    names = {"broker", "controller", "reward-0", "rollout-0", "rollout-1", "trainer-rank0", "trainer-rank1"}

    def all_placed():
        assert driver.poll() is None, procs.log(driver)[-3000:]
        return (p := _placed(run_dir)) and set(p) == names and p

    placed = wait_for(all_placed, 240, interval=0.5, what="every actor placed")
    trainer_node = placed["trainer-rank0"]
    assert placed["trainer-rank1"] == trainer_node != ids["head"]  # STRICT_PACK: both ranks on one GPU node
    rollout_node = ids["b"] if trainer_node == ids["a"] else ids["a"]  # the trainer holds the other's GPUs
    assert placed["rollout-0"] == placed["rollout-1"] == rollout_node
    brokers_host = load_config(run_dir / "config.yaml").brokers.host

    wait_for(lambda: (run_dir / "checkpoints" / "step00000002").is_dir(), 400, interval=0.5, what="checkpoint 2")
    assert max(_versions(run_dir)) < UNIT_STEPS - 1, "the run ended before the kill"
    pids = _placed(run_dir, "pid")
    env = {name: _environ(pid) for name, pid in pids.items()}
    given = _placed(run_dir, "gpus")  # the GPU ids Ray gave each rank's actor
    for rank in (0, 1):  # the unit's two GPUs on its node, each rank's own at its LOCAL_RANK
        e = env[f"trainer-rank{rank}"]
        visible = e["CUDA_VISIBLE_DEVICES"].split(",")
        assert sorted(visible) == ["0", "1"] and (e["RANK"], e["LOCAL_RANK"], e["WORLD_SIZE"]) == (
            str(rank), str(rank), "2"), e
        assert [visible[rank]] == given[f"trainer-rank{rank}"], (visible, given)
        assert e["MASTER_ADDR"] == brokers_host and e["TORCHELASTIC_USE_AGENT_STORE"] == "True"  # brokers' host
    assert sorted(env[f"rollout-{i}"]["CUDA_VISIBLE_DEVICES"] for i in (0, 1)) == ["0", "1"]  # one GPU each
    for name in ("broker", "controller", "reward-0"):  # asked for none: see none
        assert env[name]["CUDA_VISIBLE_DEVICES"] == "", name

    os.kill(pids["trainer-rank1"], signal.SIGKILL)
    wait_for(lambda: _placed(run_dir, "pid")["trainer-rank0"] != pids["trainer-rank0"], 120, interval=0.5,
             what="the trainer unit restarted")
    assert _gone(pids["trainer-rank0"]), "rank 0 of the dead unit still runs"
    assert driver.wait(400) == 0, procs.log(driver)[-3000:]
    restarted = [r for r in _events(run_dir, "launcher.child_restarted") if r["child"] == "trainer"]
    assert len(restarted) == 1 and "trainer-rank1" in restarted[0]["reason"] and "SIGKILL" in restarted[0]["reason"]
    again = [r for r in _events(run_dir, "launcher.placed") if r["child"].startswith("trainer-rank")][-2:]
    assert {r["attempt"] for r in again} == {1} and {r["node_id"] for r in again} == {trainer_node}  # same bundles
    started = _events(run_dir, "trainer.started")
    assert started[-1]["world_size"] == 2 and started[-1]["version"] >= 2  # resumed from a checkpoint, not from 0
    _audit(run_dir, UNIT_STEPS)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_layouts_the_cluster_cannot_hold_are_refused_before_anything_starts(gpu_cluster, procs, tmp_path):
    """GPUs no node has stop `areal-mq run --backend ray` with exit 2 and the reason, before any role process
    starts. (A zmq-publishing trainer spread over nodes is no longer refused: each rank serves from its node's IP,
    trainer.weight_server_hosts.)"""
    c, _ = gpu_cluster
    cases = [(["placement.rollout.gpus_per_process=3"], "one rollout process asks for 3 GPUs but the largest node "
              "offers 2")]
    for i, (sets, reason) in enumerate(cases):
        run_dir = tmp_path / f"run{i}"
        driver = procs.start(["run", str(TINY), "--backend", "ray", "--address", c.address, "--skip-eval", "--quiet",
                              "--set", f"run.run_dir={run_dir}", *[x for s in sets for x in ("--set", s)]], f"driver{i}")
        assert driver.wait(120) == 2, procs.log(driver)[-3000:]
        assert reason in " ".join(procs.log(driver).split()), procs.log(driver)[-3000:]
        assert not (run_dir / "logs").exists() or not any((run_dir / "logs").iterdir())  # no role started
