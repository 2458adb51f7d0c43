"""BrokerBackend (the OpenAI endpoint's JobClient owner thread) with a stand-in client passed in: answers reach
their callers, broker errors map to HTTP statuses, a silent broker fails calls at once (503), a deadline gives 504
and the job is forgotten (no resubmission).

Run: pytest tests/unit/test_openai_backend.py -q   (~3 s)
"""
import threading

import pytest

from areal_mq.messages import Error, GenerateResult, SamplingSpec
from areal_mq.openai.api import ApiError
from areal_mq.openai.backend import BrokerBackend


class Link:
    def __init__(self):
        self.silent, self.delay = 0.0, 0.0

    def silent_s(self, now):
        return self.silent


class FakeClient:
    """JobClient's surface: submit, poll, pending, link; `answer` decides what each job gets (None = nothing)."""

    address = "tcp://127.0.0.1:1"

    def __init__(self, answer):
        self.answer, self.link, self.pending, self.lock = answer, Link(), {}, threading.Lock()
        self.submitted = []

    def submit(self, msg, service=""):
        job_id = f"j{len(self.submitted)}"
        self.submitted.append(msg)
        self.pending[job_id] = msg
        return job_id

    def poll(self, timeout):
        out = []
        for job_id, msg in list(self.pending.items()):
            reply = self.answer(msg)
            if reply is not None:
                del self.pending[job_id]
                out.append((job_id, reply))
        threading.Event().wait(timeout)
        return out

    def close(self):
        pass


def ok(msg):
    return GenerateResult(output_ids=[1, 2], logprobs=[-0.1, -0.2], versions=[5, 5], finish_reason="stop", text="hi")


def run(answer, n=1, timeout_s=5.0, silent=False):
    client = FakeClient(answer)
    client.link.silent = 100.0 if silent else 0.0
    backend = BrokerBackend(lambda: client, silent_after_s=1.0, poll_s=0.01)
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
    client = FakeClient(lambda msg: None)
    backend = BrokerBackend(lambda: client, silent_after_s=1.0, poll_s=0.01)
    backend.start()
    try:
        with pytest.raises(ApiError) as info:
            backend.generate([1, 2], [SamplingSpec(), SamplingSpec()], ["", ""], 0.3)
        assert info.value.status == 504
        threading.Event().wait(0.2)  # the owner thread's next step drops both jobs
        assert client.pending == {} and len(client.submitted) == 2
    finally:
        backend.close()


def test_a_call_waits_while_the_broker_answers_late():
    calls = {"n": 0}

    def late(msg):
        calls["n"] += 1
        return ok(msg) if calls["n"] > 30 else None

    out, _ = run(late, timeout_s=10.0)
    assert out[0].versions.tolist() == [5, 5]
