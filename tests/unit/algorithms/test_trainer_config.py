"""The trainer config and the off-policy validator's refusal."""
from __future__ import annotations

import pytest
from pydantic import ValidationError

from areal_mq.algorithms.config import TrainerConfig, validate_off_policy
from areal_mq.algorithms.optim import lr_factor
from areal_mq.errors import ConfigError


def test_async_without_behaviour_correction_is_refused_with_an_explanation():
    with pytest.raises(ConfigError) as err:
        validate_off_policy(2, TrainerConfig(behav_correction=False))
    text = str(err.value)
    assert "max_staleness=2" in text and "behav_correction=true" in text
    assert "allow_uncorrected_off_policy=true" in text


def test_allowed_combinations():
    validate_off_policy(0, TrainerConfig(behav_correction=False))  # synchronous: nothing is stale
    validate_off_policy(4, TrainerConfig())  # corrected (the default)
    validate_off_policy(4, TrainerConfig(behav_correction=False, allow_uncorrected_off_policy=True))


def test_root_config_applies_the_validator():
    from areal_mq.config import config_from_dict

    bad = {"controller": {"max_staleness": 3}, "trainer": {"behav_correction": False}}
    with pytest.raises(ConfigError, match="behav_correction"):
        config_from_dict(bad)
    bad["trainer"]["allow_uncorrected_off_policy"] = True
    assert config_from_dict(bad).trainer.allow_uncorrected_off_policy


def test_unknown_keys_and_inconsistent_cap_are_rejected():
    with pytest.raises(ValidationError, match="extra"):
        TrainerConfig(lr_warmup=3)
    with pytest.raises(ValidationError, match="needs a behav_weight_cap"):
        TrainerConfig(behav_cap_mode="mask", behav_weight_cap=None)


def test_lr_schedule_shapes():
    cfg = TrainerConfig(warmup_steps=4, lr_schedule="linear", decay_steps=14, min_lr_ratio=0.1)
    assert [lr_factor(s, cfg) for s in range(4)] == pytest.approx([0.2, 0.4, 0.6, 0.8])
    assert lr_factor(4, cfg) == 1.0 and lr_factor(9, cfg) == pytest.approx(0.55)
    assert lr_factor(14, cfg) == pytest.approx(0.1) and lr_factor(100, cfg) == pytest.approx(0.1)
    cos = TrainerConfig(lr_schedule="cosine", decay_steps=10, min_lr_ratio=0.0)
    assert lr_factor(5, cos) == pytest.approx(0.5) and lr_factor(10, cos) == pytest.approx(0.0)
