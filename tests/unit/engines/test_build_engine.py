"""build_engine: the configured engine is built lazily; unknown engines get a clear ConfigError."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from areal_mq.engines import build_engine
from areal_mq.engines.base import Engine, EngineRequest
from areal_mq.messages import SamplingSpec
from areal_mq.engines.config import EngineConfig
from areal_mq.errors import ConfigError


def test_builds_the_torch_engine_from_model_config(tiny_tokenizer):
    model_cfg = SimpleNamespace(name="tiny-random-llama", dtype="float32", cache_dir=None)
    engine = build_engine(EngineConfig(max_concurrent=2, threads=1), model_cfg, seed=3, tokenizer=tiny_tokenizer)
    try:
        assert isinstance(engine, Engine) and engine.seed == 3
        engine.submit(EngineRequest("a", [1, 2, 3], SamplingSpec(max_new_tokens=2, ignore_eos=True)))
        outs = []
        while engine.has_work():
            outs += engine.step()
        assert len(outs[0].output_ids) == 2 and engine.stats()["engine"] == "torch"
    finally:
        engine.close()


def test_unknown_engine_is_a_config_error():
    with pytest.raises(ConfigError, match="unknown engine 'nope'"):
        build_engine(SimpleNamespace(kind="nope"))
