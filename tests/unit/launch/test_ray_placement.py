"""The Ray backend's placement rules without Ray (areal_mq/launch/ray_placement.py): N GPUs each from placement,
the trainer's bundles, the GPU demand refused before anything starts (naming the role and the numbers), each
actor's devices checked, and the environment of each trainer rank (torch's rank variables, the rendezvous at
the brokers' host, the unit's GPUs on the rank's node). tests/integration/test_ray_backend.py runs it on a
Ray cluster and reads the environment of every process."""
from __future__ import annotations

import pytest

from areal_mq.config import config_from_dict
from areal_mq.errors import ConfigError
from areal_mq.launch.ray_placement import (actor_devices, check_gpu_demand, rank_envs, role_request, trainer_bundle,
                                           uses_placement)

CPU_ONLY = {"CPU": 8}


def _cfg(**placement_and_launcher):
    launcher = {"backend": "ray", **placement_and_launcher.pop("launcher", {})}
    return config_from_dict({"launcher": launcher, "placement": placement_and_launcher})


def test_gpus_each_from_placement():
    cfg = _cfg(launcher={"trainer_ranks": 4, "rollout_workers": 2, "threads": {"trainer": 2}},
               trainer={"gpus_per_process": 1}, rollout={"gpus_per_process": 2})
    assert uses_placement(cfg)
    assert role_request("rollout", cfg, CPU_ONLY) == {"num_cpus": 1, "num_gpus": 2, "resources": {}}
    assert role_request("trainer", cfg, CPU_ONLY)["num_gpus"] == 1
    assert trainer_bundle(cfg, CPU_ONLY) == {"CPU": 2, "GPU": 1}
    assert role_request("reward", cfg, CPU_ONLY)["num_gpus"] == 0
    labelled = {**CPU_ONLY, "areal_rollout": 4}  # a labelled node keeps its label and adds the GPUs
    assert role_request("rollout", cfg, labelled) == {"num_cpus": 0, "num_gpus": 2, "resources": {"areal_rollout": 1}}
    assert not uses_placement(_cfg())
    assert trainer_bundle(_cfg(launcher={"trainer_ranks": 2}), {"CPU": 8, "GPU": 1}) == {"CPU": 1}  # 1 GPU < 2 ranks
    assert trainer_bundle(_cfg(launcher={"trainer_ranks": 2}), {"CPU": 8, "GPU": 2}) == {"GPU": 1}


def test_gpus_named_twice_must_agree():
    cfg = _cfg(launcher={"ray_resources": {"rollout": {"num_gpus": 1}}}, rollout={"gpus_per_process": 2})
    with pytest.raises(ConfigError, match="disagree"):
        role_request("rollout", cfg, CPU_ONLY)


@pytest.mark.parametrize("setup, nodes, match", [
    ({"launcher": {"trainer_ranks": 4, "rollout_workers": 2}, "trainer": {"gpus_per_process": 1},
      "rollout": {"gpus_per_process": 2}}, [{"GPU": 4}],
     r"asks Ray for 8 GPUs \(trainer 4 x 1, rollout 2 x 2\).*offers 4"),
    ({"rollout": {"gpus_per_process": 4}}, [{"GPU": 3}, {"GPU": 3}], "one rollout process asks for 4 GPUs but the "
     "largest node offers 3"),  # (and the trainer its default GPU)
    ({"launcher": {"trainer_ranks": 4}, "trainer": {"gpus_per_process": 1}}, [{"GPU": 2}, {"GPU": 2}],
     "packed on one node .*STRICT_PACK.* offers 2 GPUs; use PACK"),
])
def test_missing_gpus_are_refused_with_the_numbers(setup, nodes, match):
    cfg = _cfg(**setup)
    cluster = {"CPU": 8, "GPU": sum(n["GPU"] for n in nodes)}
    with pytest.raises(ConfigError, match=match):
        check_gpu_demand(cfg, cluster, nodes)


def test_a_trainer_may_span_nodes_when_asked():
    cfg = _cfg(launcher={"trainer_ranks": 4, "ray_trainer_strategy": "PACK"}, trainer={"gpus_per_process": 1})
    check_gpu_demand(cfg, {"GPU": 4}, [{"GPU": 2}, {"GPU": 2}])


def test_each_actor_sees_exactly_its_gpus():
    assert actor_devices(["3", "5"], 2, True, "rollout-0") == "3,5"
    assert actor_devices([], 0, True, "reward-0") == ""  # the run places GPUs: none for a role that asked none
    assert actor_devices([], 0, False, "reward-0") is None  # no placement: the environment is left alone
    with pytest.raises(ConfigError, match=r"rollout-1 asked Ray for 2 GPU\(s\) and was given 1 \(\['4'\]\)"):
        actor_devices(["4"], 2, True, "rollout-1")
    with pytest.raises(ConfigError, match=r"given GPU\(s\) \['4'\] twice"):
        actor_devices(["4", "4"], 2, True, "rollout-1")


def test_rank_environments():
    where = [{"node_id": "nodeA", "gpus": ["2"]}, {"node_id": "nodeA", "gpus": ["0"]},
             {"node_id": "nodeB", "gpus": ["1"]}]
    envs = rank_envs(where, "10.0.0.9", 29511, 3, True)
    assert [e["RANK"] for e in envs] == ["0", "1", "2"] and {e["WORLD_SIZE"] for e in envs} == {"3"}
    assert [e["LOCAL_RANK"] for e in envs] == ["0", "1", "0"]
    assert [e["LOCAL_WORLD_SIZE"] for e in envs] == ["2", "2", "1"]
    assert [e["GROUP_RANK"] for e in envs] == ["0", "0", "1"]
    assert [e["CUDA_VISIBLE_DEVICES"] for e in envs] == ["2,0", "2,0", "1"]  # a rank's GPU at its LOCAL_RANK
    assert {(e["MASTER_ADDR"], e["MASTER_PORT"], e["TORCHELASTIC_USE_AGENT_STORE"], e["TORCHELASTIC_RESTART_COUNT"])
            for e in envs} == {("10.0.0.9", "29511", "True", "3")}
    cpu = rank_envs([{"node_id": "n", "gpus": []}] * 2, "h", 1, 0, False)
    assert all("CUDA_VISIBLE_DEVICES" not in e for e in cpu)
    with pytest.raises(ConfigError, match=r"trainer ranks \[0, 1\] on node nodeA were given GPU\(s\) \['0'\] twice"):
        rank_envs([{"node_id": "nodeA", "gpus": ["0"]}, {"node_id": "nodeA", "gpus": ["0"]}], "h", 1, 0, True)


def test_the_shipped_two_node_7b_config_fits_two_nodes_of_8(tmp_path):
    """configs/qwen2.5-7b-2nodes.yaml against the public 7B config (areal_mq/engines/shapes.py; nothing is
    downloaded): `areal-mq plan` fits it on 80 GB GPUs (8 FSDP ranks, 8 engines), Ray's GPU demand fits two
    nodes of 8 with the trainer packed on one, and is refused on one node or on 40 GB cards."""
    from pathlib import Path

    from areal_mq.config import load_config
    from areal_mq.engines.shapes import hf_config
    from areal_mq.launch.plan import GIB, make_plan

    model = tmp_path / "qwen2.5-7b"
    hf_config("qwen2.5-7b").save_pretrained(str(model))
    cfg = load_config(Path(__file__).resolve().parents[3] / "configs" / "qwen2.5-7b-2nodes.yaml",
                      [f"model.name={model}"])
    result = make_plan(cfg, device_gib=80)
    assert not result.refusals, result.table()
    rank, engine = result.processes
    assert (rank.count, engine.count) == (8, 8)
    assert 20 * GIB < rank.nbytes < 30 * GIB and 50 * GIB < engine.nbytes < 70 * GIB, result.table()
    assert make_plan(cfg, device_gib=40).refusals  # neither fits a 40 GB card
    assert cfg.job_leases()["generate"] == 60 + 8192 / 5  # an 8k-token answer's lease
    two_nodes = [{"CPU": 64, "GPU": 8}, {"CPU": 64, "GPU": 8}]
    check_gpu_demand(cfg, {"CPU": 128, "GPU": 16}, two_nodes)
    with pytest.raises(ConfigError, match="asks Ray for 16 GPUs"):
        check_gpu_demand(cfg, {"CPU": 64, "GPU": 8}, two_nodes[:1])
    assert trainer_bundle(cfg, {"GPU": 16}) == {"CPU": 4, "GPU": 1}
