"""OpenAIBackend (the OpenAI endpoint's JobClient owner thread) on the kit's InMemoryJobs: answers reach
their callers, broker errors map to HTTP statuses, a silent broker fails calls at once (503), a deadline gives 504
and the job is forgotten (no resubmission), a failed choice's unanswered siblings are forgotten too.

Run: pytest tests/unit/openai/test_backend.py -q   (~3 s)
"""
import threading

import pytest

from areal_mq.messages import Error, GenerateResult, SamplingSpec
from areal_mq.openai.api import ApiError
from areal_mq.openai.backend import OpenAIBackend
from areal_mq.testing import InMemoryJobs, wait_for


def ok(msg):
    return GenerateResult(output_ids=[1, 2], logprobs=[-0.1, -0.2], versions=[5, 5], finish_reason="stop", text="hi")


def run(answer, n=1, timeout_s=5.0, silent=False):
    client = InMemoryJobs(answerer=answer)
    client.link.silent = 100.0 if silent else 0.0
    backend = OpenAIBackend(lambda: client, silent_after_s=1.0, poll_s=0.01)
    backend.start()
    try:
        out = backend.generate([1, 2, 3], [SamplingSpec(seed=i) for i in range(n)], ["ep"] + [""] * (n - 1), timeout_s)
        return out, client
    finally:
        backend.close()


def test_answers_come_back_in_choice_order_with_sessions_set():
    out, client = run(ok, n=3)
    assert [r.text for r in out] == ["hi"] * 3
    assert [m.session for m in client.submitted] == ["ep", "", ""]
    assert [m.sampling.seed for m in client.submitted] == [0, 1, 2]


@pytest.mark.parametrize("code, status", [("bad_request", 400), ("queue_full", 503), ("no_service", 503),
                                          ("internal", 502)])
def test_broker_errors_map_to_http_statuses(code, status):
    with pytest.raises(ApiError) as info:
        run(lambda msg: Error(code=code, message="nope"))
    assert info.value.status == status and code in info.value.message


def test_a_silent_broker_is_503_without_waiting_for_the_deadline():
    with pytest.raises(ApiError) as info:
        run(lambda msg: None, timeout_s=60.0, silent=True)
    assert info.value.status == 503 and "not answering" in info.value.message


def test_a_missed_deadline_is_504_and_the_job_is_forgotten():
    client = InMemoryJobs(answerer=lambda msg: None)
    backend = OpenAIBackend(lambda: client, silent_after_s=1.0, poll_s=0.01)
    backend.start()
    try:
        with pytest.raises(ApiError) as info:
            backend.generate([1, 2], [SamplingSpec(), SamplingSpec()], ["", ""], 0.3)
        assert info.value.status == 504
        wait_for(lambda: client.pending == {}, 10, what="both jobs forgotten")  # by the owner thread's next step
        assert len(client.submitted) == 2
    finally:
        backend.close()


def test_a_failed_choice_forgets_its_unanswered_siblings():
    def refuse_first(msg):
        return Error(code="bad_request", message="no") if msg.sampling.seed == 0 else None

    client = InMemoryJobs(answerer=refuse_first)
    backend = OpenAIBackend(lambda: client, silent_after_s=1.0, poll_s=0.01)
    backend.start()
    try:
        with pytest.raises(ApiError) as info:
            backend.generate([1, 2], [SamplingSpec(seed=0), SamplingSpec(seed=1)], ["", ""], 60.0)
        assert info.value.status == 400
        wait_for(lambda: client.pending == {}, 10, what="seed 1 forgotten")  # cancelled, forgotten: not resubmitted
    finally:
        backend.close()


def test_calls_still_waiting_at_close_get_503():
    client = InMemoryJobs(answerer=lambda msg: None)
    backend = OpenAIBackend(lambda: client, silent_after_s=1.0, poll_s=0.01)
    backend.start()
    errors = []

    def call():
        try:
            backend.generate([1], [SamplingSpec()], [""], 60.0)
        except ApiError as exc:
            errors.append(exc)

    caller = threading.Thread(target=call)
    caller.start()
    wait_for(lambda: len(client.submitted) == 1, 10, what="the call's job")
    backend.close()
    caller.join(10.0)
    assert [e.code for e in errors] == ["shutting_down"] and errors[0].status == 503


def test_a_call_waits_while_the_broker_answers_late():
    calls = {"n": 0}

    def late(msg):
        calls["n"] += 1
        return ok(msg) if calls["n"] > 30 else None

    out, _ = run(late, timeout_s=10.0)
    assert out[0].versions.tolist() == [5, 5]


def test_a_streamed_call_yields_its_partials_then_its_result_and_a_partial_never_ends_it():
    from areal_mq.messages import GeneratePartial

    client = InMemoryJobs()
    backend = OpenAIBackend(lambda: client, silent_after_s=1.0, poll_s=0.01)
    backend.start()
    try:
        events = backend.stream([1, 2], SamplingSpec(), "ep", 5.0)
        wait_for(lambda: client.pending, 10, what="the streamed job submitted")
        (job_id,) = client.pending
        assert client.pending[job_id].stream and client.pending[job_id].session == "ep"
        for k in range(2):
            client.answer(job_id, GeneratePartial(output_ids=[1], logprobs=[-0.1], versions=[5], start=k, seq=k))
        first = next(events)
        assert isinstance(first, GeneratePartial) and job_id in client.pending  # still running
        client.answer(job_id, ok(None))
        rest = list(events)
        assert [type(e).__name__ for e in rest] == ["GeneratePartial", "GenerateResult"]
    finally:
        backend.close()


def test_a_stream_whose_reader_goes_away_forgets_its_job():
    client = InMemoryJobs()
    backend = OpenAIBackend(lambda: client, silent_after_s=1.0, poll_s=0.01)
    backend.start()
    try:
        events = backend.stream([1, 2], SamplingSpec(), "", 60.0)
        wait_for(lambda: client.pending, 10, what="the streamed job submitted")
        events.close()  # the HTTP client disconnected before anything came
        wait_for(lambda: client.pending == {} and client.forgotten, 10, what="the job forgotten")
    finally:
        backend.close()
