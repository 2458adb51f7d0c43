"""The generation:training split recommendation (areal_mq/balance.py): a pure function of live figures, and the
controller's advisor that feeds it. The sweep against the best split lives in `benchmarks/speed/scale.py --balance`.

Run: pytest tests/unit/sim/test_balance.py -q
"""
from __future__ import annotations

import pytest

from areal_mq.balance import SplitAdvisor, recommend_split
from areal_mq.config import load_config


def split(gen=24, train=8, gen_busy=1.0, train_busy=1.0, rate=10.0, **kw):
    # steady state: samples generated per second == samples trained per second == rate
    return recommend_split(gen_devices=gen, train_devices=train, gen_tokens_per_s=rate * 1000, tokens_per_sample=1000,
                           trained_samples_per_s=rate, gen_busy=gen_busy, train_busy=train_busy, **kw)


def test_both_phases_busy_keeps_the_split():
    s = split()
    assert (s.gen_devices, s.train_devices) == (24, 8) and s.reason.startswith("balanced")


def test_an_idle_trainer_gives_devices_to_generation():
    s = split(train_busy=0.25)  # the trainer needs 2 of its 8 devices: 24 + 6 generation devices balance it
    assert s.gen_devices == 30 and s.train_devices == 2 and "training has spare capacity" in s.reason


def test_idle_generation_gives_devices_to_training_and_names_the_backlog():
    s = split(gen_busy=0.5, store_depth=640, batch_samples=128, staleness_mean=1.8, eta=2)
    assert s.gen_devices == 19 and s.train_devices == 13  # 24 x 0.5 : 8 x 1 busy device-seconds = 0.6
    assert "generation has spare capacity" in s.reason and "5.0 batches" in s.reason and "near η=2" in s.reason


def test_fraction_is_each_phase_share_of_busy_device_seconds():
    s = split(gen=20, train=12, gen_busy=0.9, train_busy=0.3)
    assert s.gen_fraction == pytest.approx(20 * 0.9 / (20 * 0.9 + 12 * 0.3))


def test_too_little_activity_and_bad_input():
    assert split(train_busy=0.0).reason.startswith("not enough activity")
    assert split(rate=0.0).gen_devices == 24
    with pytest.raises(ValueError, match="at least one device per phase"):
        split(train=0)
    assert split(train_busy=0.01, gen=30, train=2).train_devices >= 1  # never below one device per phase


def test_advisor_recommends_once_per_window_from_the_controller_figures():
    cfg = load_config(None, ["rollout.engine.kind=sim", "rollout.engine.sim.workers=24", "trainer.sim.enabled=true",
                             "trainer.sim.devices=8", "rollout.engine.max_concurrent=4", "controller.batch_groups=24",
                             "controller.group_size=4"])
    adv = SplitAdvisor.from_config(cfg)
    assert (adv.gen_devices, adv.train_devices, adv.slots, adv.batch_samples) == (24, 8, 96, 96)
    adv.weights({"train_busy": 0.25})
    adv.observe(96)
    assert adv.report(0.0, 0, 0, 0, 0, 0.0) is None  # the first report only starts the window
    assert adv.report(5.0, 10_000, 10, 1, 0, 0.0) is None  # shorter than window_s
    adv.observe(96)
    s = adv.report(20.0, 192_000, 192, 2, 0, 0.0)  # 192 samples generated and 2 x 96 trained in 20 s
    assert s is not None and s.gen_devices == 30
