"""The rollout worker's loop logic with an in-memory engine and runtime (passed in, not patched):

- a failed weight load is retried with backoff; when it keeps failing, the requests held for that version
  are answered Error(weights_unavailable) instead of waiting for a version that never comes;
- an engine output the engine could not finish properly (a broken vLLM stream: error, versions -1, NaN
  logprobs) is answered Error(job_failed), never as a GenerateResult the store would take;
- a bus replay of (0, "base") never takes the worker's weights back; a real older version is loaded.
Run: pytest tests/unit/workers/test_rollout_worker_logic.py -q
"""
from __future__ import annotations

import time

import numpy as np
import pytest

from areal_mq.config import load_config
from areal_mq.engines.base import EngineOutput
from areal_mq.errors import WeightsFetchError
from areal_mq.messages import Error, GenerateRequest, GenerateResult, SamplingSpec, WeightsReady
from areal_mq.workers import rollout
from areal_mq.workers.rollout import RolloutWorker
from areal_mq.actor.link import Job
from areal_mq.testing import FakeRuntime


class FakeEngine:
    """Loads fail `fail_loads` times; step() returns whatever the test put in `finished`."""

    def __init__(self, fail_loads: int = 0):
        self.version, self.fail_loads, self.loads = 0, fail_loads, []
        self.submitted, self.finished = [], []

    def update_weights(self, version, tensors=None, path=None):
        self.loads.append(version)
        if self.fail_loads:
            self.fail_loads -= 1
            raise WeightsFetchError(f"cannot read {path}")
        self.version = version
        return {"load_s": 0.01}

    def submit(self, request):
        self.submitted.append(request.request_id)

    def step(self):
        out, self.finished = self.finished, []
        return out

    def has_work(self):
        return bool(self.submitted)

    def abort(self, request_id):
        return None

    def stats(self):
        return {}


@pytest.fixture
def clock():
    """The worker's monotonic clock, moved by the test (the backoff would otherwise take seconds)."""
    return [1000.0]


def _worker(tmp_path, engine, clock=None):
    cfg = load_config(None, [f"run.run_dir={tmp_path}"])
    rt = FakeRuntime("generate", "rollout-test", role="rollout")
    return RolloutWorker(cfg, engine, rt, clock=(lambda: clock[0]) if clock else time.monotonic)


def _ready(tmp_path, version):
    return WeightsReady(version=version, mode="disk", path=str(tmp_path / "weights" / f"v{version}"))


def _job(job_id, min_version=0):
    return Job(job_id, GenerateRequest(prompt_ids=[1, 2], sampling=SamplingSpec(max_new_tokens=4),
                                       min_version=min_version))


def test_a_failed_load_is_retried_with_backoff_then_releases_held_requests(tmp_path, clock):
    engine = FakeEngine(fail_loads=2)
    w = _worker(tmp_path, engine, clock)
    w.on_job(_job("a", min_version=1))
    w.load(_ready(tmp_path, 1))
    assert engine.version == 0 and w.held
    waits = []
    while engine.version == 0:
        due = w.retry_load[2]
        waits.append(due - clock[0])
        clock[0] = due - 0.01
        w.retry_load_if_due()
        assert len(engine.loads) == len(waits), "retried before its pause was over"
        clock[0] = due
        w.retry_load_if_due()
    assert waits == [0.5, 1.0] and engine.loads == [1, 1, 1]
    w.release_held()
    assert engine.submitted == ["a"] and not w.rt.replies
    assert [kw["attempt"] for kw in w.rt.log.named("rollout.weights_retry")] == [1, 2]


def test_a_load_that_keeps_failing_answers_held_requests_with_a_retryable_error(tmp_path, clock):
    engine = FakeEngine(fail_loads=100)
    w = _worker(tmp_path, engine, clock)
    for job_id, v in (("a", 1), ("b", 1), ("later", 2)):
        w.on_job(_job(job_id, min_version=v))
    w.load(_ready(tmp_path, 1))
    for _ in range(rollout.WEIGHTS_LOAD_ATTEMPTS + 2):
        if w.retry_load is not None:
            clock[0] = w.retry_load[2]
        w.retry_load_if_due()
    assert len(engine.loads) == rollout.WEIGHTS_LOAD_ATTEMPTS, "bounded attempts"
    for job_id in ("a", "b"):
        err = w.rt.replies[job_id]
        assert isinstance(err, Error) and err.code == "weights_unavailable" and "version 1" in err.message
    assert "later" not in w.rt.replies and [j.id for j in w.held] == ["later"]  # v2 may still come
    assert w.rt.log.named("rollout.weights_failed")[0]["attempts"] == rollout.WEIGHTS_LOAD_ATTEMPTS
    # the controller resubmits for v1: the worker tries that version afresh
    engine.fail_loads = 0
    w.on_job(_job("again", min_version=1))
    w.retry_load_if_due()
    w.release_held()
    assert engine.version == 1 and "again" in engine.submitted


def test_a_newer_announcement_supersedes_a_pending_retry(tmp_path, clock):
    engine = FakeEngine(fail_loads=1)
    w = _worker(tmp_path, engine, clock)
    w.on_job(_job("a", min_version=1))
    w.load(_ready(tmp_path, 1))
    w.load(_ready(tmp_path, 2))
    assert engine.version == 2 and w.retry_load is None
    w.release_held()
    assert engine.submitted == ["a"]


def _output(rid, **kw):
    base = dict(request_id=rid, prompt_ids=[1, 2], output_ids=np.array([5, 6], np.int32),
                logprobs=np.array([-0.1, -0.2], np.float32), versions=np.array([0, 0], np.int32),
                finish_reason="stop", text="x")
    return EngineOutput(**{**base, **kw})


@pytest.mark.parametrize("broken", [
    {"stats": {"error": "RemoteDisconnected: Remote end closed connection"}, "finish_reason": "abort"},
    {"versions": np.array([-1, -1], np.int32)},
    {"logprobs": np.array([-0.1, np.nan], np.float32)},
])
def test_a_broken_engine_output_is_an_error_not_a_result(tmp_path, broken):
    engine = FakeEngine()
    w = _worker(tmp_path, engine)
    w.on_job(_job("bad"))
    w.on_job(_job("good"))
    engine.finished = [_output("bad", **broken), _output("good")]
    w.step()
    assert isinstance(w.rt.replies["bad"], Error) and w.rt.replies["bad"].code == "job_failed"
    assert isinstance(w.rt.replies["good"], GenerateResult)


def test_a_base_replay_never_takes_the_weights_back(tmp_path):
    engine = FakeEngine()
    w = _worker(tmp_path, engine)
    w.load(_ready(tmp_path, 3))
    w.load(WeightsReady(version=0, mode="base"))  # a restarted bus's replay
    assert engine.version == 3 and engine.loads == [3]
    w.load(_ready(tmp_path, 2))  # a real older version: the trainer resumed from a checkpoint
    assert engine.version == 2


def test_control_pause_pauses_the_engine_and_the_loop_stops_stepping(tmp_path):
    """A vLLM engine generates in the background: skipping step() alone would not stop it, so the rollout
    role's pause hook pauses the engine itself (Engine.pause), and resume undoes it."""
    from areal_mq.messages import Control
    from areal_mq.actor.roles import PauseControl, RoleLoop

    class PausableEngine(FakeEngine):
        def __init__(self):
            super().__init__()
            self.calls = []

        def pause(self):
            self.calls.append("pause")

        def resume(self):
            self.calls.append("resume")

    engine = PausableEngine()
    w = _worker(tmp_path, engine)
    loop = RoleLoop(w.rt, w, [PauseControl()])
    pause = loop.middleware[0]
    pause.signal(loop, Control(action="pause", target_role="rollout"))
    assert w.paused and engine.calls == ["pause"] and w.rt.readies == [0]
    w.on_job(_job("a"))
    engine.finished = [_output("a")]
    assert w.on_tick() is False and "a" not in w.rt.replies  # paused: no step
    pause.signal(loop, Control(action="pause"))  # already paused: nothing happens
    pause.signal(loop, Control(action="resume"))
    assert not w.paused and engine.calls == ["pause", "resume"] and w.rt.readies == [0, 4]
    assert w.on_tick() is True and isinstance(w.rt.replies["a"], GenerateResult)


def test_of_several_queued_announcements_only_the_newest_is_loaded(tmp_path):
    """A worker cut off from the bus for a while gets a burst of WeightsReady when it is back; the older ones
    are pruned already, so loading them one by one (each failing, each retried) only delays generation."""
    engine = FakeEngine()
    w = _worker(tmp_path, engine)
    w.on_job(_job("a", min_version=5))
    for v in (2, 3, 4, 5):
        w.on_signal(_ready(tmp_path, v))
    w.on_tick()
    assert engine.loads == [5] and engine.submitted == ["a"]


def test_the_session_of_a_request_reaches_the_engine(tmp_path):
    """Turns of one episode carry GenerateRequest.session; the engine needs it to reuse the previous turn's KV."""
    seen = []

    class Recording(FakeEngine):
        def submit(self, request):
            seen.append((request.request_id, request.session))
            super().submit(request)

    w = _worker(tmp_path, Recording())
    w.on_job(Job("t1", GenerateRequest(prompt_ids=[1, 2], session="ep-7")))
    w.on_job(_job("plain"))
    assert seen == [("t1", "ep-7"), ("plain", "")]


def _finish(w, engine, job_id):
    """The engine finishes `job_id` at its next step (the worker answers it), then holds nothing of it."""
    engine.finished.append(EngineOutput(request_id=job_id, prompt_ids=[1, 2], output_ids=[5], logprobs=[-0.1], versions=[engine.version],
                                        finish_reason="stop", text="x"))
    w.on_tick()
    engine.submitted.remove(job_id)


def _fetched(w):
    """Wait for the fetch thread (a disk fetch of a missing directory fails fast, so fake a done fetch)."""
    while w.fetching is not None and not w.fetching.done.is_set():
        time.sleep(0.01)


class _Done:
    def __init__(self, ready):
        self.ready, self.attempt, self.t0, self.error = ready, 1, time.perf_counter(), None
        self.update = type("U", (), {"fallback": None, "patches": None, "kwargs": {"path": ready.path},
                                     "route": "full", "fetched_bytes": 0, "full_bytes": 0, "fetch_s": 0.0,
                                     "failures": [], "adapter": None})()
        self.done = type("E", (), {"is_set": lambda self: True})()


@pytest.mark.parametrize("interruptible", [True, False])
def test_an_update_interrupts_running_sequences_unless_generation_is_not_interruptible(tmp_path, interruptible):
    cfg = load_config(None, [f"run.run_dir={tmp_path}", f"rollout.interruptible={str(interruptible).lower()}"])
    engine = FakeEngine()
    w = RolloutWorker(cfg, engine, FakeRuntime("generate", "rollout-test", role="rollout"))
    w.catchup.commit = lambda update: None
    w.on_job(_job("running"))
    w.fetching = _Done(_ready(tmp_path, 1))  # version 1 fetched while "running" decodes
    w.on_tick()
    if interruptible:
        assert engine.loads == [1] and engine.version == 1  # applied at once: "running" goes on under v1
        return
    assert engine.loads == [] and w.update_waiting()  # waits for "running" to finish
    w.on_job(_job("new"))  # arrives meanwhile: waits for the update, it does not start under v0
    assert engine.submitted == ["running"] and [j.id for j in w.deferred] == ["new"]
    assert w.stats()["deferred"] == 1
    _finish(w, engine, "running")  # "running" finishes under v0 and is answered
    assert isinstance(w.rt.replies["running"], GenerateResult) and w.rt.replies["running"].versions == [0]
    w.on_tick()  # then v1 is applied and "new" starts under v1
    assert engine.loads == [1] and engine.version == 1 and engine.submitted == ["new"] and not w.deferred
    _finish(w, engine, "new")
    assert w.rt.replies["new"].versions == [1]  # one sequence, one version


def test_not_interruptible_a_cuda_ipc_update_waits_for_running_sequences_too(tmp_path):
    cfg = load_config(None, [f"run.run_dir={tmp_path}", "rollout.interruptible=false"])
    engine = FakeEngine()
    w = RolloutWorker(cfg, engine, FakeRuntime("generate", "rollout-test", role="rollout"))
    applied = []
    w.take = lambda ready, attempt=1: applied.append(ready.version)
    w.on_job(_job("running"))
    w.on_signal(WeightsReady(version=1, mode="cuda_ipc", path=str(tmp_path)))
    w.on_tick()
    w.on_job(_job("new"))
    assert applied == [] and [j.id for j in w.deferred] == ["new"]
    _finish(w, engine, "running")
    assert applied == []
    w.on_tick()
    assert applied == [1]


@pytest.mark.parametrize("audit", [True, False])
def test_audit_weights_logs_the_checksum_of_every_tensor_the_engine_holds_after_a_load(tmp_path, audit):
    """rollout.audit_weights (the soak's engine weight audit, issue 40): after a load, the checksum (the trainer's,
    weights/delta.py) of each of the engine's tensors in the published dtype; off by default: no pass over them."""
    import torch

    from areal_mq.weights.delta import checksum

    engine = FakeEngine()
    engine.model = torch.nn.Linear(3, 2)
    cfg = load_config(None, [f"run.run_dir={tmp_path}", f"rollout.audit_weights={str(audit).lower()}",
                             "trainer.publish_dtype=bfloat16"])
    rt = FakeRuntime("generate", "rollout-test", role="rollout")
    RolloutWorker(cfg, engine, rt).load(_ready(tmp_path, 3))
    audits = [f for _, e, f in rt.log.records if e == "rollout.weights_audit"]
    if not audit:
        assert audits == []
        return
    (got,) = audits
    want = {k: checksum(t.detach().to(torch.bfloat16).contiguous()) for k, t in engine.model.state_dict().items()}
    assert got["version"] == 3 and got["checksums"] == want and set(want) == {"weight", "bias"}


def test_a_measured_decode_rate_too_slow_for_the_generate_lease_is_named_once_a_minute(tmp_path, clock):
    engine = FakeEngine()
    w = _worker(tmp_path, engine, clock)
    lease, longest = w.lease_s, w.cfg.controller.max_new_tokens
    assert lease >= 60 + longest / w.cfg.brokers.min_decode_tokens_per_s

    def finish(rids, tokens, seconds):  # requests submitted together, finished together `seconds` later
        rids = [rids] if isinstance(rids, str) else rids
        for rid in rids:
            w.on_job(_job(rid))
        clock[0] += seconds
        engine.finished = [_output(rid, output_ids=np.arange(tokens, dtype=np.int32),
                                   logprobs=np.zeros(tokens, np.float32), versions=np.zeros(tokens, np.int32))
                           for rid in rids]
        w.step()

    def warned():
        return [r for r in w.rt.log.records if r[1] == "rollout.lease_too_short"]

    fast = 2 * longest / lease  # a max_new_tokens answer takes half the lease
    finish("a", 32, 32 / fast)
    assert not warned() and w.stats()["row_tokens_per_s"] == pytest.approx(fast, rel=1e-3)
    slow = 0.25 * longest / lease  # four times the lease: the broker would take long answers back
    finish([f"s{i}" for i in range(12)], 32, 32 / slow)
    assert len(warned()) == 1  # the average crossed; at most one line a minute
    fields = warned()[0][2]
    assert fields["longest_answer_s"] > fields["generate_lease_s"] and "min_decode_tokens_per_s" in fields["hint"]
    finish("late", 32, 61.0)  # a minute later, still slow on average
    assert len(warned()) == 2
    finish("short", 8, 100.0)  # under 16 tokens: not a measure of decode speed
    assert len(warned()) == 2
