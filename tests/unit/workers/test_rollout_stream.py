"""Partial outputs of streamed requests on the rollout worker (engine and runtime in memory, passed in):

- a request with stream=True gets GeneratePartials while it decodes: bounded (at most one per interval, at most
  MAX_PARTIAL_TOKENS each), in order (start, seq), with the per-token versions of a weight update mid-answer, and
  none after its GenerateResult, which still holds every token;
- a training request (stream False) gets none;
- the message itself is bounded: no empty or oversized partial, lengths must match.
Run: pytest tests/unit/workers/test_rollout_stream.py -q
"""
from __future__ import annotations

import numpy as np
import pytest
from pydantic import ValidationError

from areal_mq.actor.link import Job
from areal_mq.config import load_config
from areal_mq.engines.base import EngineOutput
from areal_mq.messages import MAX_PARTIAL_TOKENS, GeneratePartial, GenerateRequest, GenerateResult, SamplingSpec
from areal_mq.testing import FakeRuntime
from areal_mq.workers.rollout import RolloutWorker
from areal_mq.workers.rollout_stream import StreamedRequests


class GrowingEngine:
    """Each step appends one token to every running request (version = the engine's version); a request finishes
    after `length` tokens. `progress` reads the tokens so far, as the torch engine's does."""

    def __init__(self, length: int):
        self.version, self.length, self.running = 3, length, {}

    def submit(self, request):
        self.running[request.request_id] = ([], [], [])

    def step(self):
        done = []
        for rid, (ids, lps, vers) in list(self.running.items()):
            ids.append(100 + len(ids)), lps.append(-0.5), vers.append(self.version)
            if len(ids) == self.length:
                del self.running[rid]
                done.append(EngineOutput(rid, [1], np.array(ids, np.int32), np.array(lps, np.float32),
                                         np.array(vers, np.int32), "stop", text="x"))
        return done

    def progress(self, rid):
        return self.running.get(rid)

    def has_work(self):
        return bool(self.running)

    def abort(self, rid):
        return None

    def stats(self):
        return {}


def _worker(tmp_path, engine, clock):
    cfg = load_config(None, [f"run.run_dir={tmp_path}"])
    rt = FakeRuntime("generate", "rollout-test", role="rollout")
    return RolloutWorker(cfg, engine, rt, clock=lambda: clock[0]), rt


def _job(job_id, stream):
    return Job(job_id, GenerateRequest(prompt_ids=[1, 2], sampling=SamplingSpec(max_new_tokens=8), stream=stream))


def test_a_streamed_request_gets_bounded_partials_then_its_result(tmp_path):
    clock = [100.0]
    engine = GrowingEngine(length=7)
    worker, rt = _worker(tmp_path, engine, clock)
    worker.on_job(_job("s", True))
    worker.on_job(_job("t", False))  # training traffic: no partials
    for i in range(7):
        if i == 4:
            engine.version = 4  # a weight update mid-answer: the same stream goes on, later tokens say 4
        worker.step()
        clock[0] += 0.03 if i % 2 else 0.0  # faster than the interval: tokens wait for the next partial
    parts = rt.partials["s"]
    assert "t" not in rt.partials
    assert [p.seq for p in parts] == list(range(len(parts))) and 1 < len(parts) < 7  # rate-bounded
    joined = np.concatenate([p.output_ids for p in parts])
    assert [p.start for p in parts] == np.cumsum([0] + [len(p.output_ids) for p in parts[:-1]]).tolist()
    result = rt.replies["s"]
    assert isinstance(result, GenerateResult) and result.versions.tolist() == [3, 3, 3, 3, 4, 4, 4]
    assert joined.tolist() == result.output_ids[:len(joined)].tolist()  # a view of the answer, never more
    assert np.concatenate([p.versions for p in parts]).tolist() == result.versions[:len(joined)].tolist()
    assert not worker.streams.running  # forgotten with its result


def test_partials_are_cut_to_max_tokens():
    ids = list(range(10))
    streams = StreamedRequests(lambda rid: (ids, [0.0] * 10, [1] * 10), interval_s=0.0, max_tokens=4)
    streams.started(_job("a", True))
    got = [p for _ in range(4) for _, p in streams.due(0.0)]
    assert [(p.start, len(p.output_ids)) for p in got] == [(0, 4), (4, 4), (8, 2)]


@pytest.mark.parametrize("n", [0, MAX_PARTIAL_TOKENS + 1])
def test_a_partial_is_bounded(n):
    with pytest.raises(ValidationError, match="MAX_PARTIAL_TOKENS"):
        GeneratePartial(output_ids=[1] * n, logprobs=[0.0] * n, versions=[0] * n, start=0, seq=0)
    with pytest.raises(ValidationError, match="length mismatch"):
        GeneratePartial(output_ids=[1, 2], logprobs=[0.0], versions=[0, 0], start=0, seq=0)
