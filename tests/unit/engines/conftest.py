"""Shared fixtures of the engine tests: the real tiny model (built once into the user cache)."""
from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing in these tests may reach a hub

import pytest


@pytest.fixture(scope="session")
def tiny_model_dir():
    from areal_mq.engines.models import resolve_model

    return resolve_model("tiny-random-llama")


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model_dir):
    from areal_mq.engines.models import load_tokenizer

    return load_tokenizer(tiny_model_dir)


@pytest.fixture
def make_engine(tiny_model_dir, tiny_tokenizer):
    """Factory: a TorchEngine on the tiny model with EngineConfig overrides; closed after the test."""
    from areal_mq.engines.config import EngineConfig
    from areal_mq.engines.torch.engine import TorchEngine

    import torch

    engines, threads = [], torch.get_num_threads()

    def make(**overrides):
        # one thread: the tiny model gains nothing from two, and a busy shared CPU hurts two a lot
        cfg = EngineConfig(**{"seed": 0, "threads": 1, **overrides})
        engine = TorchEngine(tiny_model_dir, cfg, dtype="float32", tokenizer=tiny_tokenizer)
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        engine.close()
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def hf_tiny(tiny_model_dir):
    """An independent HF copy of the tiny model (float32) for reference computations."""
    from areal_mq.engines.models import load_causal_lm

    return load_causal_lm(tiny_model_dir)


@pytest.fixture(scope="session")
def prompts(tiny_tokenizer):
    """A few chat-templated prompts of different lengths."""
    from areal_mq.engines.models import apply_chat_template

    texts = ["Hi", "What is 17 * 3? Think step by step.", "Name three rivers in Europe, please.",
             "Write one sentence about a cat who learns to fly a small plane."]
    return [apply_chat_template(tiny_tokenizer, t) for t in texts]
