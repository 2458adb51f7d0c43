"""areal_mq/devices.py: the one device setting (auto | cpu | cuda | cuda:N), its validation and per-role override.
Run: pytest tests/unit/test_devices.py -q
"""
from __future__ import annotations

import pytest
import torch

from areal_mq.config import RunConfig
from areal_mq.devices import check_device_spec, resolve_device, role_device
from areal_mq.errors import ConfigError


def test_auto_is_cuda_when_available_else_cpu():
    expected = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    assert resolve_device("auto") == expected
    assert resolve_device(None) == expected  # an unset override means auto


def test_cpu_and_meta_resolve_as_named():
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("meta") == torch.device("meta")


@pytest.mark.parametrize("bad", ["gpu", "cuda:", "cuda:x", "CPU", "", "cuda:0 ", 3])
def test_a_bad_spec_is_a_config_error_naming_the_choices(bad):
    with pytest.raises(ConfigError, match="auto, cpu, cuda, cuda:N"):
        check_device_spec(bad)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
@pytest.mark.parametrize("spec", ["cuda", "cuda:0", "cuda:3"])
def test_cuda_without_cuda_is_a_config_error_saying_what_torch_sees(spec):
    with pytest.raises(ConfigError, match="sees no CUDA device.*use device: cpu or auto"):
        resolve_device(spec)


@pytest.mark.gpu
def test_cuda_resolves_to_an_indexed_device_and_a_missing_index_is_refused():
    assert resolve_device("cuda") == torch.device("cuda", 0)
    with pytest.raises(ConfigError, match="CUDA device\\(s\\)"):
        resolve_device(f"cuda:{torch.cuda.device_count()}")


def test_a_role_override_wins_over_the_model_device():
    cfg = RunConfig.model_validate({"model": {"device": "cpu"}, "rollout": {"device": "meta"}})
    assert role_device(cfg, "rollout") == "meta"
    assert role_device(cfg, "trainer") == "cpu"  # no trainer.device: model.device
    assert role_device(cfg, "no_such_role") == "cpu"
    assert RunConfig().model.device == "auto"


def test_the_config_refuses_a_bad_device_before_any_process_starts():
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="pattern"):
        RunConfig.model_validate({"model": {"device": "gpu0"}})
