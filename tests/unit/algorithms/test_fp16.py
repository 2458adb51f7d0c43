"""trainer.precision fp16: fp16 autocast with dynamic loss scaling (areal_mq/algorithms/scaler.py), on the tiny
model (this CPU computes fp16 matmuls ~40x slower than fp32, so correctness only; the sharded case with an
overflow on one rank only is in tests/integration/test_trainer_fsdp.py).

Run: pytest tests/unit/algorithms/test_fp16.py -q
"""
from __future__ import annotations

import math

import pytest
import torch

from areal_mq.algorithms.config import TrainerConfig
from areal_mq.algorithms.scaler import LossScaler
from areal_mq.algorithms.trainer import Trainer, compute_precision
from areal_mq.config import load_config
from areal_mq.errors import ConfigError
from tests.unit.algorithms.batches import make_samples

CFG = dict(lr=1e-3, max_tokens_per_mb=64, seed=3, ppo_n_minibatches=2, checkpoint_every=0)


def _params(trainer) -> dict:
    return {n: p.detach().clone() for n, p in trainer.unwrapped.state_dict().items()}


def test_fp16_trains_close_to_fp32_and_reports_its_loss_scale(tiny_model_dir):
    batch = make_samples(7, n_groups=2, group_size=3, version=0, staleness=0)
    fp32 = Trainer(TrainerConfig(precision="fp32", **CFG), tiny_model_dir, device="cpu").train_step(batch)
    fp16 = Trainer(TrainerConfig(precision="fp16", **CFG), tiny_model_dir, device="cpu")
    before = _params(fp16)
    m = fp16.train_step(batch)
    assert fp16.precision == "fp16" and m["loss_scale"] == 65536.0 and m["fp16_skipped_steps"] == 0
    assert math.isfinite(m["loss"]) and m["grad_norm"] > 0
    # same weights, same batch: fp16 numbers are fp32's within fp16 rounding
    assert m["loss"] == pytest.approx(fp32["loss"], rel=5e-2, abs=5e-3)
    assert m["grad_norm"] == pytest.approx(fp32["grad_norm"], rel=5e-2)
    after = _params(fp16)
    assert any(not torch.equal(before[k], after[k]) for k in before)  # it stepped
    assert all(v.dtype == torch.float32 for v in after.values())  # master weights stay fp32


def test_an_overflowing_step_is_skipped_and_the_scale_backs_off(tiny_model_dir):
    trainer = Trainer(TrainerConfig(precision="fp16", **CFG), tiny_model_dir, device="cpu")
    trainer.scaler.scale = 1e38  # any gradient through an fp16 op overflows
    before = _params(trainer)
    m = trainer.train_step(make_samples(8, n_groups=2, group_size=3, version=0, staleness=0))
    assert m["fp16_skipped_steps"] == 2  # both mini-batches overflowed: no optimizer step at all
    assert m["loss_scale"] == pytest.approx(1e38 / 4)
    assert trainer.optimizer_steps == 0 and m["grad_norm"] == 0.0
    assert math.isfinite(m["loss"])  # the reported loss is unscaled
    after = _params(trainer)
    assert all(torch.equal(before[k], after[k]) for k in before)  # nothing moved, nothing became inf


def test_the_loss_scale_survives_a_checkpoint(tiny_model_dir, tmp_path):
    from areal_mq.algorithms.checkpoint import load_checkpoint, save_checkpoint

    trainer = Trainer(TrainerConfig(precision="fp16", **CFG), tiny_model_dir, device="cpu")
    trainer.scaler.scale, trainer.scaler.good_steps, trainer.scaler.skipped = 1024.0, 7, 3
    path = save_checkpoint(trainer, tmp_path)
    fresh = Trainer(TrainerConfig(precision="fp16", **CFG), tiny_model_dir, device="cpu")
    load_checkpoint(fresh, path)
    assert fresh.scaler.state_dict() == {"scale": 1024.0, "good_steps": 7, "skipped": 3}


def test_scaler_grows_after_an_interval_of_finite_steps_and_never_falls_below_its_floor():
    s = LossScaler(init_scale=8.0, growth_interval=3, min_scale=2.0)
    finite, inf = torch.tensor(1.0), torch.tensor(float("inf"))
    assert [s.update(finite) for _ in range(3)] == [True] * 3 and s.scale == 16.0
    assert not s.update(torch.tensor(float("nan"))) and s.scale == 8.0 and s.good_steps == 0
    for _ in range(5):
        s.update(inf)
    assert s.scale == 2.0 and s.skipped == 6
    p = torch.nn.Parameter(torch.ones(3))
    p.grad = torch.full((3,), 4.0)
    s.unscale_([p])
    assert p.grad.tolist() == [2.0, 2.0, 2.0]


def test_fp16_config_rules():
    assert compute_precision(TrainerConfig(), "float16") == "fp16"
    assert compute_precision(TrainerConfig(), "bfloat16") == "bf16"
    assert compute_precision(TrainerConfig(precision="fp32"), "float16") == "fp32"
    with pytest.raises(ConfigError, match="rollout.engine.dtype float16"):
        load_config(None, ["trainer.precision=fp16"])
    cfg = load_config(None, ["trainer.precision=fp16", "rollout.engine.dtype=float16"])
    assert cfg.trainer.precision == "fp16"
    with pytest.raises(ValueError):
        TrainerConfig(loss_scale_init=0.5)
