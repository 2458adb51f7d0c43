"""placement: which GPUs each role's processes get on this host. Counts come from launcher.*; the GPU lists must
match them exactly, no GPU belongs to two roles, and each child's CUDA_VISIBLE_DEVICES is exactly its share
(roles without GPUs get an empty list once any role names some). tests/integration/test_trainer_ranks.py reads
the environments of a real run's processes."""
from __future__ import annotations

import pytest

from areal_mq.config import config_from_dict
from areal_mq.errors import ConfigError
from areal_mq.launch.launcher import Launcher

NODE = {"launcher": {"trainer_ranks": 4, "rollout_workers": 2},
        "placement": {"trainer": {"gpus": [0, 1, 2, 3]}, "rollout": {"gpus": [4, 5, 6, 7], "gpus_per_process": 2}}}


def test_each_child_gets_exactly_its_gpus(tmp_path):
    cfg = config_from_dict({**NODE, "run": {"run_dir": str(tmp_path / "r")}, "security": {"insecure": True},
                            "trainer": {"strategy": "fsdp"}})
    launcher = Launcher(cfg)
    kids = {k.name: k for k in launcher.plan(launcher.prepare())}
    assert kids["trainer"].env["CUDA_VISIBLE_DEVICES"] == "0,1,2,3"  # one torchrun unit, a GPU per rank
    assert kids["rollout-0"].env["CUDA_VISIBLE_DEVICES"] == "4,5"
    assert kids["rollout-1"].env["CUDA_VISIBLE_DEVICES"] == "6,7"
    assert kids["reward-0"].env["CUDA_VISIBLE_DEVICES"] == ""  # named no GPU: sees none
    assert kids["controller"].env["CUDA_VISIBLE_DEVICES"] == ""


def test_without_placement_the_environment_is_left_alone(tmp_path):
    cfg = config_from_dict({"run": {"run_dir": str(tmp_path / "r")}, "security": {"insecure": True}})
    launcher = Launcher(cfg)
    assert all("CUDA_VISIBLE_DEVICES" not in k.env for k in launcher.plan(launcher.prepare()))


@pytest.mark.parametrize("placement, match", [
    ({"trainer": {"gpus": [0, 1]}}, r"placement.trainer.gpus names 2 GPU\(s\) .* 4 process"),
    ({"trainer": {"gpus": [0, 1, 2, 3]}, "rollout": {"gpus": [3, 4]}}, "GPU 3 is given twice"),
    ({"trainer": {"gpus": [0, 1, 2, -3]}}, "not a GPU index"),
    ({"rollout": {"gpus": [4, 5, 6], "gpus_per_process": 2}}, r"2 process\(es\) x 2 GPU\(s\) = 4"),
])
def test_bad_placements_are_refused_by_name(placement, match):
    with pytest.raises(ConfigError, match=match):
        config_from_dict({"launcher": {"trainer_ranks": 4, "rollout_workers": 2}, "placement": placement})


def test_placement_is_for_the_local_backend():
    with pytest.raises(ConfigError, match=r"under Ray say how many each process gets \(placement.trainer.gpus_per_"):
        config_from_dict({"launcher": {"backend": "ray"}, "placement": {"trainer": {"gpus": [0]}}})
    with pytest.raises(ConfigError, match="a trainer rank has one GPU"):
        config_from_dict({"placement": {"trainer": {"gpus_per_process": 2}}})
