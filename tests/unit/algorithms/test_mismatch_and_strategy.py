"""The per-step precision metric (mismatch_kl) and the strategy config rules (trainer.strategy)."""
from __future__ import annotations

import math

import pytest
import torch

from areal_mq.algorithms.config import TrainerConfig
from areal_mq.algorithms.trainer import mismatch_stats


def test_mismatch_counts_only_staleness_zero_tokens_and_matches_k3_by_hand():
    trainer = torch.tensor([-1.0, -2.0, -3.0, -0.5])
    engine = torch.tensor([-1.1, -2.0, -1.0, -0.5 - math.log(3.0)])
    versions = torch.tensor([4, 4, 3, 4])  # the third token is one version stale: not numerics, excluded
    k3, n, out, dmax = mismatch_stats(trainer, engine, versions, version=4)
    d = [0.1, 0.0, math.log(3.0)]
    assert n.item() == 3
    assert k3.item() == pytest.approx(sum(math.expm1(x) - x for x in d))
    assert out.item() == 1  # only log 3 lies outside [log 1/2, log 2]
    assert dmax.item() == pytest.approx(math.log(3.0))


def test_identical_numbers_give_zero_mismatch():
    lp = torch.randn(50)
    k3, n, out, dmax = mismatch_stats(lp, lp.clone(), torch.zeros(50, dtype=torch.int32), version=0)
    assert (k3.item(), n.item(), out.item(), dmax.item()) == (0.0, 50, 0, 0.0)


def test_fsdp_refuses_cuda_ipc_and_unknown_strategy():
    with pytest.raises(ValueError, match="cuda_ipc"):
        TrainerConfig(strategy="fsdp", publish_mode="cuda_ipc")
    with pytest.raises(ValueError):
        TrainerConfig(strategy="zero3")
    with pytest.raises(ValueError):
        TrainerConfig(fsdp={"ofload": True})  # a typo is an error, not a silent default
    assert TrainerConfig(strategy="fsdp", fsdp={"offload": True}).fsdp.offload


def test_fsdp_names_the_families_it_supports():
    from areal_mq.algorithms.fsdp import decoder_layers
    from areal_mq.errors import ConfigError

    with pytest.raises(ConfigError, match="model.layers"):
        decoder_layers(torch.nn.Linear(2, 2))
