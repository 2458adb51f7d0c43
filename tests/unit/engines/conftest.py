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
