"""The simulated engine (areal_mq/sim/engine.py) keeps the Engine contract on a virtual clock: shapes,
per-token versions across a weight update, the modelled pause, lengths capped by max_new_tokens, abort, bad input
and bad config named clearly; and the timing models' arithmetic (areal_mq/sim/timing.py).

Run: pytest tests/unit/sim/test_sim_engine.py -q
"""
from __future__ import annotations

import numpy as np
import pytest

from areal_mq.config import load_config
from areal_mq.engines import build_engine
from areal_mq.engines.base import EngineRequest
from areal_mq.sim.engine import SimEngine
from areal_mq.errors import ConfigError, EngineRequestError
from areal_mq.messages import SamplingSpec, WeightsReady
from areal_mq.sim.timing import LENGTH_MODELS, TIMING_MODELS, length_model, timing_model
from areal_mq.testing import ManualClock
from areal_mq.weights import check_ready, resolve


def engine(clock: ManualClock, lengths: str = "constant-1k", capacity: int = 4, timing: str = "constant") -> SimEngine:
    return SimEngine(timing_model(timing), length_model(lengths), capacity, clock=clock, seed=1)


def req(rid: str, max_new: int = 4096, prompt: int = 8) -> EngineRequest:
    return EngineRequest(rid, list(range(1, prompt + 1)), SamplingSpec(max_new_tokens=max_new, seed=7))


def test_constant_decode_finishes_at_length_times_step_with_right_shapes():
    clock = ManualClock()
    eng = engine(clock)
    eng.submit(req("a"))
    assert eng.next_due() == pytest.approx(0.0)  # admission is due now
    assert eng.step() == []
    assert eng.next_due() == pytest.approx(10.0)  # 1,000 tokens x 10 ms
    clock.now = 9.99
    assert eng.step() == []
    clock.now = 10.0
    (out,) = eng.step()
    assert out.finish_reason == "stop" and len(out.output_ids) == len(out.logprobs) == len(out.versions) == 1000
    assert out.output_ids.dtype == np.int32 and out.logprobs.dtype == np.float32 and out.versions.dtype == np.int32
    assert np.isfinite(out.logprobs).all() and (out.logprobs <= 0).all() and (out.versions == 0).all()
    assert not eng.has_work() and eng.stats()["busy_s"] == pytest.approx(10.0)


def test_weight_update_mid_sequence_stamps_later_tokens_and_models_the_pause():
    clock = ManualClock()
    eng = engine(clock, timing="r1-1.5b-h800-roofline")
    eng.submit(req("a", max_new=300, prompt=100))
    eng.step()
    clock.now = 0.5
    eng.step()
    timings = eng.update_weights(3)
    assert timings["pause_s"] == TIMING_MODELS["r1-1.5b-h800-roofline"].update_pause_s
    assert timings["recompute_s"] > 0  # kv_on_update=recompute: the in-flight context is prefilled again
    clock.now = 100.0
    (out,) = eng.step()
    first = int(np.argmax(out.versions == 3))
    assert len(out.output_ids) == 300 and out.finish_reason == "length"
    assert (out.versions[:first] == 0).all() and (out.versions[first:] == 3).all() and 0 < first < 300
    assert eng.stats()["pause_s"] == pytest.approx(1.5)


def test_lengths_are_capped_long_tailed_and_reproducible():
    lm = length_model("lognormal-8k")
    a = lm.sample(np.random.default_rng(0), 20_000)
    assert a.max() == lm.cap and a.min() >= 1 and a.mean() > np.median(a)  # a right tail that reaches the cap
    assert (a == lm.sample(np.random.default_rng(0), 20_000)).all()
    clock = ManualClock()
    e1, e2 = engine(clock, "lognormal-8k", 64), engine(clock, "lognormal-8k", 64)
    for e in (e1, e2):
        for i in range(10):
            e.submit(req(f"r{i}", max_new=2000))
    clock.now = 1e6
    lens1 = sorted(len(o.output_ids) for o in e1.step())
    assert lens1 == sorted(len(o.output_ids) for o in e2.step()) and max(lens1) <= 2000


def test_capacity_queues_and_abort_returns_partial_output():
    clock = ManualClock()
    eng = engine(clock, capacity=1)
    eng.submit(req("a"))
    eng.submit(req("b"))
    clock.now = 5.0
    eng.step()
    assert eng.stats()["running"] == 1 and eng.stats()["waiting"] == 1
    out = eng.abort("a")
    assert out.finish_reason == "abort" and len(out.output_ids) == len(out.versions) == 500
    assert eng.abort("nope") is None


def test_bad_requests_and_bad_config_are_named():
    eng = engine(ManualClock())
    with pytest.raises(EngineRequestError, match="prompt_ids is empty"):
        eng.submit(EngineRequest("x", [], SamplingSpec()))
    with pytest.raises(EngineRequestError, match="max_new_tokens"):
        eng.submit(EngineRequest("x", [1], SamplingSpec(max_new_tokens=0)))
    with pytest.raises(ConfigError, match="unknown simulation timing model 'nope'.*r1-1.5b-h800-roofline"):
        load_config(None, ["rollout.engine.kind=sim", "rollout.engine.sim.timing=nope"])
    with pytest.raises(ConfigError, match="slot for measured figures"):
        load_config(None, ["trainer.sim.timing=h100-measured"])
    with pytest.raises(ConfigError, match="unknown simulation length distribution"):
        load_config(None, ["rollout.engine.sim.lengths=zipf"])
    with pytest.raises(ConfigError, match="share one virtual clock"):
        load_config(None, ["rollout.engine.kind=sim", "trainer.sim.enabled=true", "trainer.sim.time_scale=0.5"])


def test_build_engine_and_sim_weights_only_for_a_simulated_trainer():
    cfg = load_config(None, ["rollout.engine.kind=sim", "trainer.sim.enabled=true"])
    assert isinstance(build_engine(cfg.rollout.engine, cfg.model, seed=0), SimEngine)
    ready = WeightsReady(version=2, mode="sim")
    assert check_ready(ready, "/tmp/run", cfg.trainer) is None and resolve(ready, "/tmp/run", cfg.trainer) == {}
    real = load_config(None, [])
    assert "simulated trainer" in check_ready(ready, "/tmp/run", real.trainer)


def test_timing_model_arithmetic():
    tm = timing_model("r1-1.5b-h800-roofline")
    assert tm.decode_step_s(0, 100) == 0
    assert tm.decode_step_s(64, 8000) > tm.decode_step_s(8, 8000) > tm.decode_step_s(8, 100) > tm.decode_fixed_s
    assert tm.train_step_s(1_000_000, 10) == pytest.approx(tm.train_fixed_s + 1e5 * tm.train_s_per_token)
    assert all(m is None or m.source for m in TIMING_MODELS.values()) and all(m.source for m in LENGTH_MODELS.values())
