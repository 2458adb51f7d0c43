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
from areal_mq.errors import EngineRequestError, WeightsLoadError


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
    with pytest.raises(ValidationError, match="gpu_memory_utilization"):
        VllmEngineConfig(gpu_memory_utilization=0.9)
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
