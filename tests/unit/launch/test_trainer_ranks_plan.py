"""launcher.trainer_ranks: the trainer child becomes one torch.distributed.run unit on loopback; other roles and
a one-rank trainer keep their plain command; Ray refuses it with a pointer (tests/integration/test_trainer_ranks.py
runs it for real)."""
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
    with pytest.raises(ConfigError, match="backend local"):
        Launcher(cfg).plan(tmp_path / "c.yaml")
