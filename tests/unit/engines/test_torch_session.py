"""Session KV of the torch engine: turn 2 reusing turn 1's KV generates what turn 2 without reuse does
(greedy: same tokens, logprobs within 1e-5, same versions), weights changed in between follow kv_on_update,
and the kept KV is bounded (tokens, LRU, TTL) and never delays admission."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from areal_mq.engines.base import EngineRequest
from areal_mq.engines.torch.session import SessionKV, common_prefix

from .engine_refs import perturbed_state
from .test_torch_engine import greedy, run_all

pytestmark = pytest.mark.timeout(180)
N1, N2 = 12, 10  # tokens generated in turn 1 and turn 2


def _run(engine, rid, prompt, n, session="", **kw):
    engine.submit(EngineRequest(rid, list(prompt), greedy(n, ignore_eos=True, **kw), session=session))
    return run_all(engine)[rid]


def _turn2_prompt(prompt, out, tiny_tokenizer):
    feedback = tiny_tokenizer.encode(" That is wrong. Try again, carefully.", add_special_tokens=False)
    return list(prompt) + out.output_ids.tolist() + feedback


@pytest.mark.parametrize("chunk", [512, 5])
def test_turn_two_with_reused_kv_equals_turn_two_without(make_engine, prompts, tiny_tokenizer, chunk):
    reuse = make_engine(session_kv_max_tokens=4096, prefill_chunk_tokens=chunk, max_concurrent=3)
    fresh = make_engine(prefill_chunk_tokens=chunk, max_concurrent=3)
    p1 = prompts[1]
    out1 = _run(reuse, "t1", p1, N1, session="ep")
    assert reuse.stats()["session_kv_entries"] == 1 and reuse.stats()["session_kv_tokens"] == len(p1) + N1 - 1
    p2 = _turn2_prompt(p1, out1, tiny_tokenizer)
    for engine, session in ((reuse, "ep"), (fresh, "")):  # a batch mate mid-decode while turn 2 is admitted
        engine.submit(EngineRequest("mate", prompts[3], greedy(30, ignore_eos=True)))
        engine.step()
        engine.step()
        engine.submit(EngineRequest("t2", p2, greedy(N2, ignore_eos=True), session=session))
    got, want = run_all(reuse), run_all(fresh)
    stats = reuse.stats()
    assert stats["session_kv_hits"] == 1 and stats["prefill_tokens_saved"] == len(p1) + N1 - 1
    assert got["t2"].stats["prefill_tokens_saved"] == len(p1) + N1 - 1
    assert fresh.stats()["session_kv_hits"] == 0
    # turn 1's prompt (len(p1) - 1 tokens) was prefilled; turn 2 skipped len(p1) + N1 - 1: N1 fewer in all
    assert stats["prefilled_tokens"] == fresh.stats()["prefilled_tokens"] - N1
    for rid in ("t2", "mate"):
        assert got[rid].output_ids.tolist() == want[rid].output_ids.tolist()
        np.testing.assert_allclose(got[rid].logprobs, want[rid].logprobs, atol=1e-5, rtol=0)
        assert got[rid].versions.tolist() == want[rid].versions.tolist()


def test_only_the_common_prefix_is_reused(make_engine, prompts, tiny_tokenizer):
    engine = make_engine(session_kv_max_tokens=4096)
    p1 = prompts[2]
    out1 = _run(engine, "t1", p1, N1, session="ep")
    edited = _turn2_prompt(p1, out1, tiny_tokenizer)
    edited[len(p1) + 3] = (edited[len(p1) + 3] + 1) % 100  # the client re-tokenized the answer differently
    want = _run(make_engine(), "w", edited, N2)
    got = _run(engine, "t2", edited, N2, session="ep")
    assert got.stats["prefill_tokens_saved"] == len(p1) + 3
    assert got.output_ids.tolist() == want.output_ids.tolist()
    np.testing.assert_allclose(got.logprobs, want.logprobs, atol=1e-5, rtol=0)
    other = _run(engine, "t3", prompts[0] + prompts[0], 4, session="ep")  # kept by t2, shares only a prefix
    assert other.stats["prefill_tokens_saved"] == common_prefix(edited + got.output_ids.tolist()[:-1],
                                                                prompts[0] + prompts[0])


@pytest.mark.parametrize("mode", ["recompute", "keep"])
def test_weights_changed_between_turns_follow_kv_on_update(make_engine, hf_tiny, prompts, tiny_tokenizer, mode):
    engine = make_engine(session_kv_max_tokens=4096, kv_on_update=mode)
    p1 = prompts[1]
    out1 = _run(engine, "t1", p1, N1, session="ep")
    state = perturbed_state(hf_tiny, seed=7)
    engine.update_weights(1, tensors=state)
    p2 = _turn2_prompt(p1, out1, tiny_tokenizer)
    got = _run(engine, "t2", p2, N2, session="ep")
    assert got.versions.tolist() == [1] * N2
    if mode == "recompute":  # the kept KV was stale: dropped, and turn 2 is exactly a fresh v1 turn
        assert engine.stats()["session_kv_hits"] == 0 and engine.stats()["session_kv_stale"] == 1
        fresh = make_engine()
        fresh.update_weights(1, tensors=state)
        want = _run(fresh, "t2", p2, N2)
        assert got.output_ids.tolist() == want.output_ids.tolist()
        np.testing.assert_allclose(got.logprobs, want.logprobs, atol=1e-5, rtol=0)
    else:  # keep: the old KV is reused, as in-flight KV is across an update
        assert engine.stats()["session_kv_hits"] == 1 and got.stats["prefill_tokens_saved"] == len(p1) + N1 - 1


def test_kept_kv_never_delays_admission_and_sessionless_requests_keep_nothing(make_engine, prompts):
    engine = make_engine(session_kv_max_tokens=4096, max_concurrent=1)
    _run(engine, "t1", prompts[1], 4, session="ep")
    engine.submit(EngineRequest("other", prompts[2], greedy(4)))
    engine.step()
    assert engine.stats()["running"] == 1 and engine.stats()["session_kv_entries"] == 1
    run_all(engine)
    assert engine.stats()["session_kv_entries"] == 1  # "other" had no session: nothing kept for it
    off = make_engine()
    out = _run(off, "t1", prompts[1], 4, session="ep")
    assert off.stats()["session_kv_entries"] == 0 and out.stats["prefill_tokens_saved"] == 0


def _kv(n):
    return torch.zeros(2, 1, n, 4), torch.zeros(2, 1, n, 4)


def test_session_store_is_bounded_by_tokens_lru_and_ttl():
    now = [0.0]
    store = SessionKV(max_tokens=10, ttl_s=5.0, clock=lambda: now[0])
    store.keep("a", [1, 2, 3, 4], *_kv(4), kv_sig=1)
    store.keep("b", [1, 2, 3, 4], *_kv(4), kv_sig=2)
    store.keep("c", [5, 6, 7], *_kv(3), kv_sig=3)  # 11 > 10: the least recently kept ("a") goes
    assert list(store.entries) == ["b", "c"] and store.tokens == 7 and store.counters["session_kv_evicted"] == 1
    store.keep("big", list(range(11)), *_kv(11), kv_sig=4)  # larger than the whole budget: not kept
    assert "big" not in store.entries and store.tokens == 7
    store.keep("b", [9], *_kv(1), kv_sig=5)  # a session's newer turn replaces its older one
    assert store.tokens == 4 and list(store.entries) == ["c", "b"]
    now[0] = 5.5
    assert store.take("c") is None and store.counters["session_kv_expired"] == 2 and store.tokens == 0
    store.keep("d", [1], *_kv(1), kv_sig=6)
    assert store.take("d").kv_sig == 6 and store.take("d") is None  # taken once: the new turn owns it
    store.keep("e", [1], *_kv(1), kv_sig=7)
    store.clear()
    assert store.tokens == 0 and store.counters["session_kv_stale"] == 1
    assert not SessionKV(max_tokens=0, ttl_s=5.0).enabled


def test_common_prefix():
    assert common_prefix([1, 2, 3], [1, 2, 4, 5]) == 2 and common_prefix([], [1]) == 0
    assert common_prefix([1, 2], [1, 2]) == 2


def test_an_idle_engine_drops_kept_kv_after_its_ttl(make_engine, prompts):
    engine = make_engine(session_kv_max_tokens=4096, session_kv_ttl_s=30.0)
    now = [0.0]
    engine.sessions.clock = lambda: now[0]
    _run(engine, "t1", prompts[1], 4, session="ep")
    engine.step()
    assert engine.stats()["session_kv_entries"] == 1
    now[0] = 31.0
    assert engine.step() == [] and engine.stats()["session_kv_entries"] == 0
