"""The test kit (areal_mq/testing/): the doubles keep the contracts of what they stand for, and refuse misuse
with a clear error: a job answered twice, an answer to a forgotten job, a script that runs out, a clock going
back, a wait that never comes true.
Run: pytest tests/unit/test_test_kit.py -q   (~2 s)
"""
from __future__ import annotations

import asyncio
import threading
import time

import pytest

from areal_mq.actor.link import Job
from areal_mq.messages import Ack, Error, GenerateRequest, RewardJob, SamplingSpec, StatsRequest, WeightsReady
from areal_mq.testing import (FakeRuntime, InMemoryJobs, InMemoryStore, ManualClock, RecordingLog, ScriptedModel,
                              wait_for)


class CharTokenizer:
    """One token per character: enough for ScriptedModel, no model files."""

    def encode(self, text, add_special_tokens=False):
        return [ord(c) for c in text]

    def decode(self, ids):
        return "".join(chr(i) for i in ids)


def test_recording_log_keeps_levels_fields_and_bound_fields():
    log = RecordingLog()
    log.info("a.start", n=1)
    child = log.bind(worker="w1")
    child.warning("a.slow", s=2.5)
    assert log.named("a.slow") == [{"worker": "w1", "s": 2.5}]  # one list: the bound logger writes into it
    assert log.at("warning") == [("a.slow", {"worker": "w1", "s": 2.5})] and log.events[0] == ("a.start", {"n": 1})
    with pytest.raises(ValueError, match="unknown log level 'warn'"):
        log.at("warn")


def test_fake_runtime_scripts_jobs_and_signals_and_refuses_a_second_answer():
    job = Job("j1", StatsRequest())
    rt = FakeRuntime(service="reward", jobs=[job], signals=[WeightsReady(version=3, mode="base")])
    assert rt.next_signal().msg.version == 3 and rt.next_signal() is None
    assert rt.next_job() is job and rt.next_job(timeout=1.0) is None
    rt.ready(0)
    rt.ready()
    assert rt.readies == [0, 0] and rt.capacity == 0
    rt.fail(job, "job_failed", "boom")
    assert rt.replies["j1"] == Error(code="job_failed", message="boom", ref_id="j1")
    assert rt.log.named("reward.job_failed") == [{"job": "j1", "code": "job_failed", "error": "boom"}]
    with pytest.raises(AssertionError, match="j1 answered twice"):
        rt.reply(job, Ack())


def test_in_memory_jobs_deliver_answers_to_pending_jobs_only():
    jobs = InMemoryJobs()
    a, b = jobs.submit(StatsRequest(), "generate"), jobs.submit(StatsRequest(), "reward")
    assert jobs.services == {a: "generate", b: "reward"} and set(jobs.pending) == {a, b}
    assert jobs.forget(b) is True and jobs.forget(b) is False
    jobs.answer(a, Ack(ref_id=a))
    jobs.answer(b, Ack(ref_id=b))  # forgotten: dropped, as JobClient drops it
    assert jobs.poll() == [(a, Ack(ref_id=a))] and jobs.pending == {} and jobs.dropped == [b]
    assert jobs.poll() == []


def test_in_memory_jobs_poll_waits_for_an_answer_from_another_thread():
    jobs = InMemoryJobs()
    job_id = jobs.submit(StatsRequest())
    threading.Timer(0.05, jobs.answer, (job_id, Ack())).start()
    t0 = time.monotonic()
    assert jobs.poll(timeout=30.0) == [(job_id, Ack())]
    assert time.monotonic() - t0 < 20.0  # woken by the answer, not by the timeout


def test_in_memory_jobs_answerer_answers_what_it_can():
    jobs = InMemoryJobs(answerer=lambda msg: Ack() if msg.prompt_ids == [1] else None)
    yes, no = jobs.submit(GenerateRequest(prompt_ids=[1])), jobs.submit(GenerateRequest(prompt_ids=[2]))
    assert jobs.poll() == [(yes, Ack())] and list(jobs.pending) == [no]


def test_in_memory_store_and_manual_clock():
    store = InMemoryStore()
    store.put("s1")
    assert store.samples == ["s1"]
    clock = ManualClock(10.0)
    assert clock() == 10.0 and clock.advance(2.5) == 12.5 and clock() == 12.5
    with pytest.raises(ValueError, match="does not go back"):
        clock.advance(-1.0)


def test_wait_for_returns_the_value_or_names_what_never_came():
    calls = []
    assert wait_for(lambda: calls.append(1) or len(calls) >= 3 and "done", 10, interval=0.001) == "done"
    with pytest.raises(AssertionError, match="timed out after 0.05s waiting for the moon"):
        wait_for(lambda: False, 0.05, interval=0.01, what="the moon")
    with pytest.raises(ValueError, match="positive timeout"):
        wait_for(lambda: True, 0)
    with pytest.raises(ValueError, match="interval >= 0"):
        wait_for(lambda: True, 1, interval=-1)
    polls = []  # interval 0: a predicate that blocks by itself is called again at once
    assert wait_for(lambda: polls.append(1) or len(polls) >= 3, 1, interval=0.0)


def test_scripted_model_answers_turns_in_order_and_says_when_the_script_ran_out():
    model = ScriptedModel(CharTokenizer(), ["ab"], version=4, rewards=lambda job: 0.5)
    req = GenerateRequest(prompt_ids=[1, 2], sampling=SamplingSpec(), session="ep-1")
    out = asyncio.run(model.generate(req))
    assert out.text == "ab" and list(out.versions) == [4, 4] and list(out.logprobs) == pytest.approx([-0.1, -0.1])
    assert len(model.requests) == 1 and model.requests[0] is req
    with pytest.raises(AssertionError, match="asked for turn 2, but the script has 1 text"):
        asyncio.run(model.generate(req))
    assert asyncio.run(model.reward(RewardJob(task="t", completions=["x", "y"]))).rewards == [0.5, 0.5]
    with pytest.raises(AssertionError, match="no `rewards=` was given"):
        asyncio.run(ScriptedModel(CharTokenizer(), []).reward(RewardJob(task="t", completions=["x"])))
