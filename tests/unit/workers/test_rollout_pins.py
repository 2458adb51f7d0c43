"""Pinned generation requests (GenerateRequest.pin_version, eval.via rollout) in the real RolloutWorker, with the
in-memory engine and runtime of test_rollout_worker_logic.py and a clock the test moves:

- a worker below the pin holds the request until it loads exactly that version;
- while pinned requests run, a fetched newer version waits (training requests go on at the pinned version), and
  PIN_LINGER_S after the last pinned answer it is applied;
- a pinned request reaching a worker past its version, or one that jumped past it, is answered Error(version_passed);
- the hold is bounded: past pin_hold_limit_s the update goes in (rollout.pin_hold_expired);
- with rollout.interruptible false a pinned request at the engine's version starts even while an update waits.
Run: pytest tests/unit/workers/test_rollout_pins.py -q
"""
from __future__ import annotations

import pytest

from areal_mq.actor.link import Job
from areal_mq.config import load_config
from areal_mq.messages import Error, GenerateRequest, GenerateResult, SamplingSpec, WeightsReady
from areal_mq.testing import FakeRuntime
from areal_mq.workers.rollout import RolloutWorker
from areal_mq.workers.rollout_pins import PIN_LINGER_S, pin_hold_limit_s

from .test_rollout_worker_logic import FakeEngine, _Done, _finish, _ready


@pytest.fixture
def clock():
    return [1000.0]


def _worker(tmp_path, clock, *sets):
    cfg = load_config(None, [f"run.run_dir={tmp_path}", *sets])
    engine = FakeEngine()
    w = RolloutWorker(cfg, engine, FakeRuntime("generate", "rollout-test", role="rollout"), clock=lambda: clock[0])
    w.catchup.commit = lambda update: None  # the faked fetches (_Done) carry no real update to record
    return w, engine


def _pinned(job_id, version):
    return Job(job_id, GenerateRequest(prompt_ids=[1, 2], sampling=SamplingSpec(temperature=0.0, max_new_tokens=4),
                                       min_version=version, pin_version=version))


def _training(job_id, version=0):
    return Job(job_id, GenerateRequest(prompt_ids=[1, 2], sampling=SamplingSpec(max_new_tokens=4), min_version=version))


def _apply(w, tmp_path, version):
    """Version `version` fetched and applied at the next tick (the engine holds nothing pinned)."""
    w.fetching = _Done(_ready(tmp_path, version))
    w.on_tick()


def test_a_pinned_request_waits_below_its_version_and_starts_at_it(tmp_path, clock):
    w, engine = _worker(tmp_path, clock)
    w.on_job(_pinned("eval", 1))
    assert engine.submitted == [] and [j.id for j in w.held] == ["eval"]
    _apply(w, tmp_path, 1)
    assert engine.version == 1 and engine.submitted == ["eval"] and w.stats()["pinned"] == 1


def test_pinned_requests_defer_a_newer_version_until_they_finish(tmp_path, clock):
    w, engine = _worker(tmp_path, clock)
    _apply(w, tmp_path, 1)
    w.on_job(_pinned("eval", 1))
    w.on_job(_training("train-a", 1))
    w.fetching = _Done(_ready(tmp_path, 2))  # v2 fetched while both decode
    w.on_tick()
    assert engine.version == 1 and w.fetching is not None, "the pinned request holds v2 back"
    w.on_job(_training("train-b", 1))  # training goes on, at the pinned version (interruptible: not deferred)
    assert "train-b" in engine.submitted and not w.deferred
    _finish(w, engine, "train-a")
    assert engine.version == 1
    _finish(w, engine, "eval")
    answer = w.rt.replies["eval"]
    assert isinstance(answer, GenerateResult) and list(answer.versions) == [1]
    w.on_tick()
    assert engine.version == 1, "the linger after the last pinned answer: the next one is a round trip away"
    clock[0] += PIN_LINGER_S + 0.01
    w.on_tick()
    assert engine.version == 2 and engine.loads == [1, 2] and w.fetching is None
    _finish(w, engine, "train-b")
    assert list(w.rt.replies["train-b"].versions) == [2]  # training requests were never pinned


def test_a_pinned_request_past_its_version_is_refused(tmp_path, clock):
    w, engine = _worker(tmp_path, clock)
    _apply(w, tmp_path, 2)
    w.on_job(_pinned("late", 1))
    err = w.rt.replies["late"]
    assert isinstance(err, Error) and err.code == "version_passed" and "version 1" in err.message
    assert engine.submitted == []


def test_a_worker_that_jumps_past_the_pin_refuses_the_held_request(tmp_path, clock):
    w, engine = _worker(tmp_path, clock)
    w.on_job(_pinned("eval", 1))
    w.on_job(_training("train", 1))
    _apply(w, tmp_path, 2)  # v1 and v2 announced together: only the newest is loaded
    assert w.rt.replies["eval"].code == "version_passed"
    assert engine.submitted == ["train"], "a training request takes any version >= its minimum"


def test_the_hold_is_bounded(tmp_path, clock):
    w, engine = _worker(tmp_path, clock)
    _apply(w, tmp_path, 1)
    w.on_job(_pinned("eval", 1))
    w.fetching = _Done(_ready(tmp_path, 2))
    w.on_tick()
    assert engine.version == 1
    clock[0] += pin_hold_limit_s(w.cfg) + 1
    w.on_tick()
    assert engine.version == 2, "past the bound the update goes in"
    assert w.rt.log.named("rollout.pin_hold_expired")[0]["pinned"] == 1


def test_the_bound_is_the_generate_lease_times_the_evaluations_waves(tmp_path):
    cfg = load_config(None, [f"run.run_dir={tmp_path}", "eval.size=20", "rollout.engine.max_concurrent=8",
                             "brokers.job_deadlines={generate: 100}"])
    assert pin_hold_limit_s(cfg) == 100 * 3 + PIN_LINGER_S


def test_a_cuda_ipc_update_waits_for_pinned_requests(tmp_path, clock):
    w, engine = _worker(tmp_path, clock)
    _apply(w, tmp_path, 1)
    taken = []
    w.take = lambda ready, attempt=1: taken.append(ready.version)
    w.on_job(_pinned("eval", 1))
    w.on_signal(WeightsReady(version=2, mode="cuda_ipc", path=str(tmp_path)))
    w.on_tick()
    assert taken == []
    _finish(w, engine, "eval")
    clock[0] += PIN_LINGER_S + 0.01
    w.on_tick()
    assert taken == [2]


def test_not_interruptible_a_pinned_request_at_the_version_starts_while_an_update_waits(tmp_path, clock):
    w, engine = _worker(tmp_path, clock, "rollout.interruptible=false")
    _apply(w, tmp_path, 1)
    w.on_job(_training("train", 1))
    w.fetching = _Done(_ready(tmp_path, 2))
    w.on_tick()
    assert w.update_waiting()
    w.on_job(_training("deferred", 1))
    w.on_job(_pinned("eval", 1))
    assert "eval" in engine.submitted and [j.id for j in w.deferred] == ["deferred"]
    _finish(w, engine, "train")
    _finish(w, engine, "eval")
    assert list(w.rt.replies["eval"].versions) == [1]
    clock[0] += PIN_LINGER_S + 0.01
    w.on_tick()
    w.on_tick()
    assert engine.version == 2 and "deferred" in engine.submitted
