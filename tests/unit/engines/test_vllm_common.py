"""Pure logic shared by the vLLM engines: request checks, version spans, weight staging, config.

Runs without vLLM installed (nothing here imports it). pytest tests/unit/engines/test_vllm_common.py
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from pydantic import ValidationError
from safetensors.torch import load_file, save_file

from areal_mq.engines.base import EngineRequest
from areal_mq.messages import SamplingSpec
from areal_mq.engines.config import EngineConfig
from areal_mq.engines.vllm.common import (
    check_request,
    cpu_env,
    resolve_weights_path,
    sampling_kwargs,
    spans_to_versions,
    staged_tensors,
)
from areal_mq.engines.vllm.config import VllmEngineConfig
from areal_mq.engines.vllm.worker import iter_safetensors, safetensors_files
from areal_mq.errors import ConfigError, EngineRequestError, WeightsLoadError


def req(prompt=(1, 2, 3), rid="r1", **sampling) -> EngineRequest:
    return EngineRequest(request_id=rid, prompt_ids=list(prompt), sampling=SamplingSpec(**sampling))


@dataclass
class Span:  # same attributes as vllm.outputs.WeightVersionSpan
    version: str
    start: int
    end: int


def test_check_request_accepts_the_convention_settings():
    check_request(req(temperature=1.0, max_new_tokens=10), max_model_len=64, vocab_size=100)
    check_request(req(temperature=0.0, top_p=0.5, top_k=3, max_new_tokens=8), max_model_len=64)  # greedy: truncation is moot


@pytest.mark.parametrize(
    "request_, words",
    [
        (req(temperature=0.7, top_p=0.9, max_new_tokens=8), "top_p=0.9"),
        (req(temperature=1.0, top_k=20, max_new_tokens=8), "top_k=20"),
        (req(prompt=()), "prompt_ids is empty"),
        (req(prompt=(1, 100)), "outside the vocabulary"),
        (req(prompt=(1,) * 60, max_new_tokens=10), "exceeds engine.max_model_len=64"),
        (req(rid="", max_new_tokens=8), "request_id"),
        (req(temperature=-1.0), "temperature"),
    ],
)
def test_check_request_names_what_is_wrong(request_, words):
    with pytest.raises(EngineRequestError, match=words.replace("(", r"\(")):
        check_request(request_, max_model_len=64, vocab_size=100)


def test_sampling_kwargs_maps_fields_and_derives_seeds():
    kw = sampling_kwargs(req(temperature=0.5, max_new_tokens=7, stop_token_ids=[2], stop_strings=["\n\n"], seed=3))
    assert kw["temperature"] == 0.5 and kw["max_tokens"] == 7 and kw["logprobs"] == 0
    assert kw["stop_token_ids"] == [2] and kw["stop"] == ["\n\n"] and kw["seed"] == 3
    assert "seed" not in sampling_kwargs(req()) and sampling_kwargs(req())["ignore_eos"] is False
    assert sampling_kwargs(req(ignore_eos=True))["ignore_eos"] is True
    a, b = sampling_kwargs(req(rid="a"), default_seed=1), sampling_kwargs(req(rid="b"), default_seed=1)
    assert a["seed"] != b["seed"] and a == sampling_kwargs(req(rid="a"), default_seed=1)


def test_spans_expand_to_per_token_versions():
    spans = [Span("3", 0, 2), Span("4", 2, 5)]
    assert spans_to_versions(spans, 5).tolist() == [3, 3, 4, 4, 4]
    assert spans_to_versions(spans, 5).dtype == np.int32
    as_json = [{"version": "7", "start": 0, "end": 3}]
    assert spans_to_versions(as_json, 3).tolist() == [7, 7, 7]
    assert spans_to_versions([], 0).tolist() == []


@pytest.mark.parametrize(
    "spans, n",
    [
        (None, 3),  # vLLM reported no label
        ([Span("default", 0, 3)], 3),  # vLLM's initial label is not a policy version
        ([Span("1", 0, 2)], 3),  # a token not covered
    ],
)
def test_spans_that_cannot_be_trusted_give_none(spans, n):
    assert spans_to_versions(spans, n) is None


def test_cpu_env_from_config():
    env = cpu_env(VllmEngineConfig(kv_cache_space_gib=3, omp_threads_bind="all"))
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "3"
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == f"0-{os.cpu_count() - 1}"
    assert env["VLLM_NO_USAGE_STATS"] == "1" and env["HF_HUB_OFFLINE"] == "1"
    assert cpu_env(VllmEngineConfig(omp_threads_bind="0"))["VLLM_CPU_OMP_THREADS_BIND"] == "0"


def test_config_refuses_settings_vllm_cpu_cannot_run():
    from areal_mq.engines.vllm.config import memory_utilization

    with pytest.raises(ValidationError, match="gpu_memory_utilization"):
        VllmEngineConfig(gpu_memory_utilization=1.0)
    assert memory_utilization(VllmEngineConfig(), on_cpu=True) == 0.5  # the CPU backend's cap
    assert memory_utilization(VllmEngineConfig(), on_cpu=False) == 0.9  # vLLM's own default on GPUs
    assert memory_utilization(VllmEngineConfig(gpu_memory_utilization=0.95), on_cpu=False) == 0.95
    with pytest.raises(ConfigError, match="fails to start above 0.5"):
        memory_utilization(VllmEngineConfig(gpu_memory_utilization=0.9), on_cpu=True)
    with pytest.raises(ValidationError, match="kv_cache_space"):
        EngineConfig(kind="vllm", vllm={"kv_cache_space_gib": 0})
    with pytest.raises(ValidationError, match="extra"):
        EngineConfig(vllm={"kv_cache": 1})


def test_staged_tensors_round_trip_and_cleanup(tmp_path):
    tensors = {"a.weight": torch.arange(6, dtype=torch.bfloat16).reshape(2, 3).t(), "b": np.ones(4, np.float32)}
    with staged_tensors(tensors, str(tmp_path)) as path:
        assert os.path.dirname(path) == str(tmp_path)
        loaded = load_file(path)
        assert torch.equal(loaded["a.weight"], tensors["a.weight"].contiguous())
        assert loaded["b"].dtype == torch.float32 and loaded["b"].sum() == 4
        assert dict(iter_safetensors(safetensors_files(path))).keys() == loaded.keys()
    assert not os.path.exists(path)
    with pytest.raises(WeightsLoadError, match="empty"):
        with staged_tensors({}, str(tmp_path)):
            pass


def test_weights_paths(tmp_path):
    with pytest.raises(WeightsLoadError, match="no safetensors weights"):
        resolve_weights_path(tmp_path / "missing")
    with pytest.raises(WeightsLoadError, match="no safetensors weights"):
        resolve_weights_path(tmp_path)  # a directory without *.safetensors
    for name in ("model-00002.safetensors", "model-00001.safetensors"):
        save_file({name: torch.zeros(1)}, str(tmp_path / name))
    assert resolve_weights_path(tmp_path) == str(tmp_path.resolve())
    assert [p.name for p in safetensors_files(tmp_path)] == ["model-00001.safetensors", "model-00002.safetensors"]


def test_packed_weights_round_trip_through_bytes():
    """An in-memory update (engine vllm) crosses vLLM's RPC as (names, dtypes, shapes, bytes) and comes back
    bit for bit, in buckets of about vllm.weight_bucket_mb; a blob of the wrong size is refused."""
    from areal_mq.engines.vllm.engine import buckets
    from areal_mq.engines.vllm.worker import pack, unpack

    tensors = {"a.weight": torch.arange(6, dtype=torch.bfloat16).reshape(2, 3).t(),  # not contiguous
               "b": np.ones(4, np.float32), "c": torch.randn(300, dtype=torch.float16), "d": torch.zeros(0, 3)}
    groups = buckets(tensors, 512)
    assert [[n for n, _ in g] for g in groups] == [["a.weight", "b"], ["c"], ["d"]]  # c (600 bytes) alone
    back = dict(pair for g in groups for pair in unpack(*pack(g)))
    for name, t in tensors.items():
        want = t if isinstance(t, torch.Tensor) else torch.from_numpy(t)
        assert back[name].dtype == want.dtype and torch.equal(back[name], want), name
    names, dtypes, shapes, blob = pack([("x", torch.ones(4))])
    with pytest.raises(ValueError, match="runs past"):
        unpack(names, dtypes, shapes, blob[:-1])
    with pytest.raises(ValueError, match="the tensors take 16"):
        unpack(names, dtypes, shapes, blob + b"\0")
    with pytest.raises(ValueError, match="unknown dtype"):
        unpack(names, ["nonsense"], shapes, blob)


def test_tensor_parallel_size_comes_from_placement():
    from areal_mq.config import config_from_dict

    cfg = config_from_dict({"rollout": {"engine": {"kind": "vllm"}}, "launcher": {"rollout_workers": 2},
                            "placement": {"rollout": {"gpus": [0, 1, 2, 3], "gpus_per_process": 2}}})
    assert cfg.rollout.engine.vllm.tensor_parallel_size == 2
    assert config_from_dict({"rollout": {"engine": {"kind": "vllm"}}}).rollout.engine.vllm.tensor_parallel_size == 1
    with pytest.raises(ConfigError, match="tensor_parallel_size 4 but placement.rollout.gpus_per_process 2"):
        config_from_dict({"rollout": {"engine": {"kind": "vllm", "vllm": {"tensor_parallel_size": 4}}},
                          "placement": {"rollout": {"gpus": [0, 1], "gpus_per_process": 2}}})


def test_a_cuda_device_pins_the_gpus_vllm_sees():
    from areal_mq.engines.vllm.engine import pin_cuda_device

    env: dict[str, str] = {}
    pin_cuda_device("cuda:3", 1, env)
    assert env == {"CUDA_VISIBLE_DEVICES": "3"}
    env = {"CUDA_VISIBLE_DEVICES": "4,5,6,7"}  # placement gave this worker four GPUs
    pin_cuda_device("cuda:2", 2, env)
    assert env["CUDA_VISIBLE_DEVICES"] == "6,7"
    for spec in ("cuda", "auto", "cpu", None):
        env = {"CUDA_VISIBLE_DEVICES": "4,5"}
        pin_cuda_device(spec, 2, env)
        assert env == {"CUDA_VISIBLE_DEVICES": "4,5"}
    with pytest.raises(ConfigError, match="needs GPUs 1..2 of the 2 this worker sees"):
        pin_cuda_device("cuda:1", 2, {"CUDA_VISIBLE_DEVICES": "4,5"})
