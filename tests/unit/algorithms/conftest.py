"""Fixtures of the trainer tests: the real tiny model (built once into the user cache) and batches of
Samples with random prompts, completions, rewards, behaviour logprobs and versions."""
from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing in these tests may reach a hub

import pytest

from tests.unit.algorithms.batches import make_samples  # noqa: F401 - re-exported for tests


@pytest.fixture(scope="session")
def tiny_model_dir():
    from areal_mq.engines.models import resolve_model

    return resolve_model("tiny-random-llama")


@pytest.fixture(autouse=True)
def _few_threads():
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)  # 2 shared cores: keep each test on one
    yield
    torch.set_num_threads(before)


@pytest.fixture(autouse=True)
def _fresh_accelerate_state():
    """Accelerate keeps process-wide state: a bf16 Trainer would make the next fp32 one fail."""
    yield
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)
