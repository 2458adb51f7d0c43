"""trainer.lora without PEFT installed: the run stops at start with a ConfigError that names the extra to install
(the launcher, before any process starts), and a trainer built elsewhere (`areal-mq worker trainer` on another
host) says the same instead of a bare ModuleNotFoundError."""
from __future__ import annotations

import sys

import pytest

from areal_mq.config import config_from_dict
from areal_mq.errors import ConfigError
from areal_mq.launch.launcher import Launcher


@pytest.fixture
def no_peft(monkeypatch):
    for name in [m for m in sys.modules if m == "peft" or m.startswith("peft.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "peft", None)  # `import peft` raises ImportError, find_spec answers None


def _cfg(tmp_path, **trainer):
    return config_from_dict({"run": {"run_dir": str(tmp_path / "r")}, "security": {"insecure": True},
                             "trainer": trainer})


def test_a_lora_run_without_peft_stops_at_start_naming_the_extra(tmp_path, no_peft):
    with pytest.raises(ConfigError, match=r"trainer.lora is set but 'peft' cannot be imported.*areal-mq\[lora\]"):
        Launcher(_cfg(tmp_path, lora={"rank": 4})).prepare()
    assert not any((tmp_path / "r" / "logs").iterdir())  # nothing started
    Launcher(_cfg(tmp_path)).prepare()  # full fine-tuning never needs it


def test_attaching_an_adapter_without_peft_is_the_same_clear_error(no_peft):
    torch = pytest.importorskip("torch")
    from areal_mq.algorithms import lora
    from areal_mq.algorithms.config import LoraConfig

    with pytest.raises(ConfigError, match=r"pip install 'areal-mq\[lora\]'.*or remove trainer.lora"):
        lora.attach(torch.nn.Linear(2, 2), LoraConfig(rank=2), torch.float32)
