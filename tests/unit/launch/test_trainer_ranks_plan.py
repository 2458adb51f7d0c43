"""launcher.trainer_ranks: the trainer child becomes one torch.distributed.run unit on loopback; other roles and
a one-rank trainer keep their plain command; under Ray each rank is an actor of its own (launch/ray_unit.py), so the
command stays plain (tests/integration/test_trainer_ranks.py and test_ray_backend.py run them for real)."""
from __future__ import annotations

import sys

import pytest

from areal_mq.config import config_from_dict
from areal_mq.errors import ConfigError
from areal_mq.launch.launcher import Launcher


def _kids(tmp_path, **launcher):
    cfg = config_from_dict({"run": {"run_dir": str(tmp_path / "r")}, "security": {"insecure": True},
                            "trainer": {"strategy": "fsdp"}, "launcher": launcher})
    launcher = Launcher(cfg)
    return {k.name: k.args for k in launcher.plan(launcher.prepare())}


def test_two_trainer_ranks_run_under_torchrun_on_loopback(tmp_path):
    kids = _kids(tmp_path, trainer_ranks=2)
    head = kids["trainer"][:9]
    assert head[:3] == [sys.executable, "-m", "torch.distributed.run"]
    assert head[3:5] == ["--nproc_per_node", "2"] and head[5:7] == ["--master_addr", "127.0.0.1"]
    assert 0 < int(head[8]) < 65536
    assert kids["trainer"][9:13] == ["-m", "areal_mq.cli", "worker", "trainer"]
    assert all("torch.distributed.run" not in args for name, args in kids.items() if name != "trainer")
    assert "torch.distributed.run" not in _kids(tmp_path)["trainer"]  # one rank: the plain worker command


def test_trainer_ranks_are_checked(tmp_path):
    with pytest.raises(ConfigError, match="trainer_ranks"):
        config_from_dict({"launcher": {"trainer_ranks": 0}})
    cfg = config_from_dict({"run": {"run_dir": str(tmp_path / "r")}, "security": {"insecure": True},
                            "launcher": {"trainer_ranks": 2, "backend": "ray"}})
    kids = {k.name: k.args for k in Launcher(cfg).plan(tmp_path / "c.yaml")}  # Ray: one actor per rank instead
    assert "torch.distributed.run" not in kids["trainer"]  # (launch/ray_unit.py; tests/integration/test_ray_backend)
