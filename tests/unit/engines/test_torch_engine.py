"""TorchEngine on the real tiny model: HF-equal greedy output, exact behaviour logprobs,
continuous batching, bad requests, abort, determinism."""
from __future__ import annotations

import pytest
import torch

from areal_mq.engines.base import EngineRequest
from areal_mq.messages import SamplingSpec
from areal_mq.errors import EngineRequestError

from .engine_refs import full_logprobs

pytestmark = pytest.mark.timeout(120)


def run_all(engine, max_steps: int = 10_000) -> dict:
    outs = {}
    for _ in range(max_steps):
        if not engine.has_work():
            break
        for out in engine.step():
            outs[out.request_id] = out
    assert not engine.has_work(), "engine did not finish"
    return outs


def greedy(n: int, **kw) -> SamplingSpec:
    return SamplingSpec(temperature=0, max_new_tokens=n, **kw)


@torch.no_grad()
def test_greedy_equals_hf_generate(make_engine, hf_tiny, prompts):
    engine = make_engine(max_concurrent=3)
    for i, p in enumerate(prompts):  # 4 prompts, 3 slots: the 4th joins when a slot frees up
        engine.submit(EngineRequest(f"g{i}", p, greedy(12 + 4 * i)))
    outs = run_all(engine)
    for i, p in enumerate(prompts):
        ref = hf_tiny.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                               max_new_tokens=12 + 4 * i, do_sample=False)[0, len(p):].tolist()
        assert outs[f"g{i}"].output_ids.tolist() == ref
        assert outs[f"g{i}"].finish_reason == ("stop" if ref[-1] in engine.eos_ids else "length")


@torch.no_grad()
def test_kv_blocks_taken_and_returned_keep_outputs_exact(make_engine, hf_tiny, prompts):
    # sequences take blocks as they grow past 128 positions; rows of different lengths finish, their blocks go
    # back to the pool and the waiting request's blocks come from them
    engine = make_engine(max_concurrent=3)
    lengths = [100, 40, 96, 60]
    for i, p in enumerate(prompts):
        engine.submit(EngineRequest(f"g{i}", p, greedy(lengths[i])))
    outs = run_all(engine)
    stats = engine.stats()
    assert stats["kv_blocks_used"] == 0 and stats["kv_blocks_peak"] * stats["kv_block_size"] > 128
    assert stats["preempted"] == 0
    for i, p in enumerate(prompts):
        ref = hf_tiny.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                               max_new_tokens=lengths[i], do_sample=False)[0, len(p):].tolist()
        assert outs[f"g{i}"].output_ids.tolist() == ref


def test_chunked_prefill_gives_the_same_tokens(make_engine, prompts):
    wide, narrow = make_engine(), make_engine(prefill_chunk_tokens=5)
    for engine in (wide, narrow):
        for i, p in enumerate(prompts):
            engine.submit(EngineRequest(f"c{i}", p, greedy(10)))
    a, b = run_all(wide), run_all(narrow)
    assert {k: v.output_ids.tolist() for k, v in a.items()} == {k: v.output_ids.tolist() for k, v in b.items()}


@pytest.mark.parametrize("temperature, top_p, top_k", [(0.0, 1.0, 0), (1.0, 1.0, 0), (0.7, 0.9, 0), (1.3, 1.0, 50)])
def test_logprobs_equal_a_fresh_forward(make_engine, hf_tiny, prompts, temperature, top_p, top_k):
    engine = make_engine()
    for i, p in enumerate(prompts):
        sp = SamplingSpec(temperature=temperature, top_p=top_p, top_k=top_k, max_new_tokens=16, ignore_eos=True)
        engine.submit(EngineRequest(f"l{i}", p, sp))
    outs = run_all(engine)
    for i, p in enumerate(prompts):
        out = outs[f"l{i}"]
        assert len(out.output_ids) == 16 and out.versions.tolist() == [0] * 16
        ref = full_logprobs(hf_tiny, p, out.output_ids.tolist(), temperature)
        torch.testing.assert_close(torch.from_numpy(out.logprobs), ref, atol=2e-4, rtol=1e-4)


def test_same_seed_same_tokens_regardless_of_batch(make_engine, prompts):
    sp = dict(temperature=1.0, top_p=0.95, max_new_tokens=20, ignore_eos=True)
    alone = make_engine()
    alone.submit(EngineRequest("x", prompts[1], SamplingSpec(seed=7, **sp)))
    crowded = make_engine()
    crowded.submit(EngineRequest("other0", prompts[0], SamplingSpec(seed=1, **sp)))
    crowded.submit(EngineRequest("x", prompts[1], SamplingSpec(seed=7, **sp)))
    crowded.submit(EngineRequest("other1", prompts[2], SamplingSpec(seed=2, **sp)))
    a, b = run_all(alone)["x"], run_all(crowded)
    assert a.output_ids.tolist() == b["x"].output_ids.tolist()
    assert b["other0"].output_ids.tolist() != b["x"].output_ids.tolist()
    other_seed = make_engine()
    other_seed.submit(EngineRequest("x", prompts[1], SamplingSpec(seed=8, **sp)))
    assert run_all(other_seed)["x"].output_ids.tolist() != a.output_ids.tolist()


def test_engine_seed_makes_unseeded_requests_reproducible(make_engine, prompts):
    runs = []
    for _ in range(2):
        engine = make_engine(seed=123)
        for i in range(2):
            engine.submit(EngineRequest(f"u{i}", prompts[0], SamplingSpec(max_new_tokens=12, ignore_eos=True)))
        runs.append({k: v.output_ids.tolist() for k, v in run_all(engine).items()})
    assert runs[0] == runs[1]
    assert runs[0]["u0"] != runs[0]["u1"]  # same prompt, different request ids -> different streams


def test_continuous_batching_admits_new_requests_and_finishes_short_first(make_engine, prompts):
    engine = make_engine(max_concurrent=2)
    engine.submit(EngineRequest("long", prompts[0], greedy(40, ignore_eos=True)))
    engine.submit(EngineRequest("short", prompts[1], greedy(4, ignore_eos=True)))
    order, steps = [], 0
    while engine.has_work():
        steps += 1
        if steps == 8:  # arrives while "long" is running
            engine.submit(EngineRequest("late", prompts[2], greedy(6, ignore_eos=True)))
            assert engine.stats()["running"] == 1 and engine.stats()["waiting"] == 1
        for out in engine.step():
            order.append((out.request_id, steps))
        if steps == 9:
            assert engine.stats()["running"] == 2  # "late" joined the running batch at a step boundary
    assert [r for r, _ in order] == ["short", "late", "long"]
    assert dict(order)["short"] == 4 and dict(order)["late"] == 8 + 6 - 1 and dict(order)["long"] == 40


def test_a_reservation_cap_set_by_the_user_limits_admission(make_engine, prompts):
    need = len(prompts[0]) + 40
    engine = make_engine(max_concurrent=4, max_reserved_tokens=max(64, need + 5))  # room for one request at a time
    for i in range(3):
        engine.submit(EngineRequest(f"k{i}", prompts[0], greedy(40, ignore_eos=True)))
    engine.step()
    assert engine.stats()["running"] == 1 and engine.stats()["waiting"] == 2
    assert engine.stats()["kv_reserved_tokens"] <= max(64, need + 5)
    assert len(run_all(engine)) == 3


def test_without_a_cap_rows_are_admitted_while_the_pool_holds_them_not_by_their_reservations(make_engine, prompts):
    """Issue 59: 8 rows that may each write 400 tokens in a pool of ~1,000 positions all start (their prompts fit);
    the old rule (reservations under max_kv_tokens) ran two. When they outgrow the pool the youngest are preempted
    and recomputed, and every request still finishes whole."""
    engine = make_engine(max_concurrent=8, max_kv_tokens=1024, max_model_len=512)
    for i in range(8):
        engine.submit(EngineRequest(f"r{i}", prompts[0], greedy(400, ignore_eos=True)))
    engine.step()
    stats = engine.stats()
    assert stats["running"] == 8 and stats["waiting"] == 0, stats
    assert stats["kv_reserved_tokens"] > stats["kv_capacity_tokens"]  # reservations beyond the pool: not a limit
    outs = run_all(engine)
    assert len(outs) == 8 and all(len(o.output_ids) == 400 for o in outs.values())
    assert engine.stats()["preempted"] > 0  # the pool ran out on the way, and the youngest gave way


@pytest.mark.parametrize(
    "prompt, sampling, match",
    [
        ([], SamplingSpec(), "empty prompt"),
        ([1, 2, 49152], SamplingSpec(), "outside the vocabulary"),
        ([1, -3], SamplingSpec(), "outside the vocabulary"),
        ([1, 2], SamplingSpec(max_new_tokens=5000), "exceeds the context limit"),
        ([1, 2], SamplingSpec(temperature=-0.5), "temperature"),
        ([1, 2], SamplingSpec(temperature=float("nan")), "temperature"),
        ([1, 2], SamplingSpec(top_p=0.0), "top_p"),
        ([1, 2], SamplingSpec(top_k=-1), "top_k"),
        ([1, 2], SamplingSpec(max_new_tokens=0), "max_new_tokens"),
        ([1, 2], SamplingSpec(stop_strings=[""]), "stop_strings"),
    ],
)
def test_bad_requests_are_refused_and_the_engine_keeps_serving(make_engine, prompts, prompt, sampling, match):
    engine = make_engine(max_model_len=256)
    engine.submit(EngineRequest("good", prompts[0], greedy(5)))
    with pytest.raises(EngineRequestError, match=match):
        engine.submit(EngineRequest("bad", prompt, sampling))
    assert set(run_all(engine)) == {"good"}


def test_duplicate_request_id_and_oversized_kv_request(make_engine, prompts):
    engine = make_engine(max_reserved_tokens=64)
    engine.submit(EngineRequest("a", prompts[0][:10], greedy(5)))
    with pytest.raises(EngineRequestError, match="already running"):
        engine.submit(EngineRequest("a", prompts[0][:10], greedy(5)))
    with pytest.raises(EngineRequestError, match="max_reserved_tokens"):
        engine.submit(EngineRequest("b", prompts[0][:10], greedy(60)))
    assert set(run_all(engine)) == {"a"}


def test_abort_returns_partial_output(make_engine, prompts):
    engine = make_engine(max_concurrent=2)
    for name in ("a", "b", "queued"):
        engine.submit(EngineRequest(name, prompts[0], greedy(30, ignore_eos=True)))
    for _ in range(5):
        engine.step()
    out = engine.abort("a")
    assert out.finish_reason == "abort" and len(out.output_ids) == 5 == len(out.logprobs) == len(out.versions)
    queued = engine.abort("queued")
    assert queued.finish_reason == "abort" and len(queued.output_ids) == 0
    assert engine.abort("a") is None and engine.abort("never") is None
    rest = run_all(engine)
    assert set(rest) == {"b"} and len(rest["b"].output_ids) == 30
    assert rest["b"].output_ids[:5].tolist() == out.output_ids.tolist()  # same prompt, greedy


def test_stop_token_ids_and_stop_strings(make_engine, tiny_tokenizer, prompts):
    probe = make_engine()
    probe.submit(EngineRequest("p", prompts[1], greedy(12, ignore_eos=True)))
    ref = run_all(probe)["p"].output_ids.tolist()
    engine = make_engine()
    engine.submit(EngineRequest("tok", prompts[1], greedy(12, stop_token_ids=[ref[3]], ignore_eos=True)))
    text = tiny_tokenizer.decode(ref[:6], skip_special_tokens=True)
    stop = text[-3:] if text[-3:].strip() else text[-4:]
    engine.submit(EngineRequest("str", prompts[1], greedy(12, stop_strings=[stop], ignore_eos=True)))
    outs = run_all(engine)
    first = ref.index(ref[3])
    assert outs["tok"].output_ids.tolist() == ref[: first + 1] and outs["tok"].finish_reason == "stop"
    assert outs["str"].finish_reason == "stop" and len(outs["str"].output_ids) <= 6
    assert stop not in outs["str"].text


def test_pause_and_resume(make_engine, prompts):
    engine = make_engine()
    engine.submit(EngineRequest("a", prompts[0], greedy(3, ignore_eos=True)))
    engine.pause()
    assert engine.step() == [] and engine.stats()["generated_tokens"] == 0 and engine.has_work()
    engine.resume()
    assert len(run_all(engine)["a"].output_ids) == 3


def test_bfloat16_engine_logprobs_close_to_hf_bfloat16(make_engine, tiny_model_dir, prompts):
    from areal_mq.engines.models import load_causal_lm

    engine = make_engine(dtype="bfloat16")
    engine.submit(EngineRequest("b", prompts[1], SamplingSpec(temperature=1.0, max_new_tokens=12, ignore_eos=True)))
    out = run_all(engine)["b"]
    ref = full_logprobs(load_causal_lm(tiny_model_dir, "bfloat16"), prompts[1], out.output_ids.tolist())
    torch.testing.assert_close(torch.from_numpy(out.logprobs), ref, atol=0.15, rtol=0.02)


@pytest.mark.slow
def test_smollm2_engine_matches_hf_generate_and_answers():
    from areal_mq.engines import build_engine
    from areal_mq.engines.config import EngineConfig
    from areal_mq.engines.models import apply_chat_template, load_causal_lm
    from types import SimpleNamespace

    engine = build_engine(EngineConfig(threads=1), SimpleNamespace(name="smollm2-135m-instruct", dtype="float32",
                                                                   cache_dir=None))
    try:
        prompt = apply_chat_template(engine.tokenizer, "What is 2+3? Answer with just the number.")
        engine.submit(EngineRequest("s", prompt, greedy(16)))
        out = run_all(engine)["s"]
        hf = load_causal_lm(engine.model.name_or_path)
        ref = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                          max_new_tokens=16, do_sample=False)[0, len(prompt):].tolist()
        assert out.output_ids.tolist() == ref and "5" in out.text and out.finish_reason == "stop"
    finally:
        engine.close()


def _group_run(engine, prompts, n=4):
    """n seeded samples of each prompt, submitted together the way the controller sends a GRPO group."""
    for i, p in enumerate(prompts):
        for k in range(n):
            sp = SamplingSpec(temperature=1.0, max_new_tokens=12, ignore_eos=True, seed=100 * i + k)
            engine.submit(EngineRequest(f"p{i}s{k}", p, sp))
    return run_all(engine)


@pytest.mark.parametrize("chunk", [512, 5])  # whole prompts in one step, and many chunks in lockstep
def test_shared_prefill_is_exact_and_computes_each_prompt_once(make_engine, prompts, chunk):
    shared, alone = make_engine(prefill_chunk_tokens=chunk), make_engine(prefill_chunk_tokens=chunk, share_prefill=False)
    a, b = _group_run(shared, prompts[:2]), _group_run(alone, prompts[:2])
    assert a.keys() == b.keys()
    for rid in a:
        assert a[rid].output_ids.tolist() == b[rid].output_ids.tolist()
        torch.testing.assert_close(torch.from_numpy(a[rid].logprobs), torch.from_numpy(b[rid].logprobs),
                                   atol=1e-5, rtol=1e-5)
    prompt_tokens = sum(len(p) - 1 for p in prompts[:2])  # the last prompt token is fed by the first decode
    assert alone.counters["prefilled_tokens"] == 4 * prompt_tokens and alone.counters["shared_prefill_tokens"] == 0
    assert shared.counters["prefilled_tokens"] + shared.counters["shared_prefill_tokens"] == 4 * prompt_tokens
    # each prompt computed once; with small chunks a prefix common to both prompts even once in all
    assert shared.counters["prefilled_tokens"] <= prompt_tokens
