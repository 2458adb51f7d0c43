"""Chunked prefill mixed with decode (issue 51 item 2): a long prompt arriving while rows decode is prefilled
`prefill_chunk_tokens` per step, in the same steps that decode every running row, so those rows get a token every
step; and the tokens are the ones an unchunked prefill gives (greedy)."""
from __future__ import annotations

import pytest

from areal_mq.engines.base import EngineRequest
from areal_mq.messages import SamplingSpec

pytestmark = pytest.mark.timeout(120)

CHUNK = 24


def _greedy(n: int) -> SamplingSpec:
    return SamplingSpec(temperature=0, max_new_tokens=n, ignore_eos=True)


def _run(engine, prompts, long_prompt, record=None):
    """Two rows start decoding; the long prompt arrives at step 3. record(engine, step) after every step."""
    outs = {}
    for i, p in enumerate(prompts):
        engine.submit(EngineRequest(f"short{i}", p, _greedy(40)))
    step = 0
    while engine.has_work():
        step += 1
        if step == 3:
            engine.submit(EngineRequest("long", long_prompt, _greedy(8)))
        outs.update({o.request_id: o.output_ids.tolist() for o in engine.step()})
        if record is not None:
            record(engine, step)
    return outs


def test_a_long_prompt_never_stops_the_running_rows(make_engine, prompts):
    long_prompt = (prompts[3] * 8)[:10 * CHUNK + 5]  # 11 chunks
    engine = make_engine(prefill_chunk_tokens=CHUNK, max_concurrent=4)
    seen: list[tuple[int, list[int], bool]] = []  # (step, short rows' generated counts, long still prefilling)

    def record(engine, step):
        rows = {s.request.request_id: s for s in engine.rows}
        counts = [len(rows[f"short{i}"].output_ids) for i in range(2) if f"short{i}" in rows]
        long_row = rows.get("long")
        seen.append((step, counts, long_row is not None and not long_row.ready))

    chunked = _run(engine, prompts[:2], long_prompt, record)
    prefilling = [(step, counts) for step, counts, busy in seen if busy]
    assert len(prefilling) >= 9  # the prompt took one chunk per step
    by_step = {step: counts for step, counts, _ in seen}
    for step, counts in prefilling:  # every step of the long prefill gave each short row one more token
        assert len(counts) == 2 and [c - p for c, p in zip(counts, by_step[step - 1])] == [1, 1], step
    whole = _run(make_engine(prefill_chunk_tokens=10_000, max_concurrent=4), prompts[:2], long_prompt)
    assert chunked == whole
