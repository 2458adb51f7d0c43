"""How engine: vllm is started and guarded, against the installed vLLM (no engine start: seconds).

Checks: the worker start method is spawn unless the user chose (and vLLM's own process factory then spawns);
the pinned vLLM release is accepted (with a local build tag) and any other refused by name, with the install
commands; the dtype vLLM runs is model.dtype on the CPU and vllm.cuda_dtype (bfloat16) on CUDA, written into the
run's config so the trainer's precision follows; the worker's device context sets vLLM's config, the model's
dtype and the worker's device for the reload.

Run: pytest -m vllm tests/integration/test_vllm_launch.py  (needs bash docker/install-vllm.sh)
"""
from __future__ import annotations

import multiprocessing
from types import SimpleNamespace

import pytest

vllm = pytest.importorskip("vllm", reason="vLLM not installed: bash docker/install-vllm.sh")

from areal_mq.algorithms.trainer import compute_precision, rollout_dtype  # noqa: E402
from areal_mq.config import RunConfig  # noqa: E402
from areal_mq.engines.vllm.common import require_vllm, start_env  # noqa: E402
from areal_mq.engines.vllm.config import configure, engine_dtype  # noqa: E402
from areal_mq.engines.vllm.worker import PINNED_VLLM, check_vllm_version, device_context  # noqa: E402

pytestmark = [pytest.mark.vllm]


def test_workers_start_by_spawn_unless_the_user_chose(monkeypatch):
    assert start_env({}) == {"VLLM_WORKER_MULTIPROC_METHOD": "spawn"}
    assert start_env({"VLLM_WORKER_MULTIPROC_METHOD": "fork"}) == {}  # the user's choice stands
    from vllm.utils.system_utils import get_mp_context

    monkeypatch.delenv("VLLM_WORKER_MULTIPROC_METHOD", raising=False)
    for key, value in start_env().items():
        monkeypatch.setenv(key, value)
    assert get_mp_context() is multiprocessing.get_context("spawn")  # what vLLM starts its processes with


def test_the_pinned_vllm_is_accepted_and_another_refused_by_name():
    assert vllm.__version__.split("+")[0] == PINNED_VLLM  # what CI installs (docker/install-vllm.sh)
    require_vllm()
    check_vllm_version(f"{PINNED_VLLM}+cu129", environ={})
    with pytest.raises(RuntimeError, match=rf"vLLM 0\.99\.1 is installed.*tested with vLLM {PINNED_VLLM}") as err:
        check_vllm_version("0.99.1", environ={})
    assert "install-vllm.sh --cuda" in str(err.value) and f"vllm=={PINNED_VLLM}" in str(err.value)
    check_vllm_version("0.99.1", environ={"AREAL_MQ_VLLM_ANY_VERSION": "1"})


def test_dtype_defaults_to_bf16_on_cuda_and_to_the_model_dtype_on_the_cpu():
    assert engine_dtype("auto", "float32", "bfloat16", on_cpu=True) == "float32"
    assert engine_dtype("auto", "float32", "bfloat16", on_cpu=False) == "bfloat16"
    assert engine_dtype("float32", "float32", "bfloat16", on_cpu=False) == "float32"  # asked for: kept
    gpu = RunConfig.model_validate({"rollout": {"engine": {"kind": "vllm"}, "device": "cuda"}})
    configure(gpu, on_cpu_build=False)
    assert gpu.rollout.engine.dtype == "bfloat16"
    assert compute_precision(gpu.trainer, rollout_dtype(gpu)) == "bf16"  # the trainer follows the engine
    cpu = RunConfig.model_validate({"rollout": {"engine": {"kind": "vllm"}, "device": "cpu"}})
    assert cpu.rollout.engine.dtype == "auto" and rollout_dtype(cpu) == "float32"
    configure(cpu, on_cpu_build=False)  # device cpu wins over the build
    assert cpu.rollout.engine.dtype == "auto"


def test_the_reload_runs_in_the_workers_device_context():
    import torch
    from vllm.config import VllmConfig, get_current_vllm_config

    config = VllmConfig()
    config.model_config = SimpleNamespace(dtype=torch.bfloat16)
    worker = SimpleNamespace(vllm_config=config, device=torch.device("meta"))
    with device_context(worker):
        assert get_current_vllm_config() is config
        made = torch.empty(3)
        assert made.device.type == "meta" and made.dtype == torch.bfloat16
    assert torch.empty(1).device.type == "cpu" and torch.get_default_dtype() == torch.float32
