"""The torch engine's paged KV (issue 42): the block pool's bookkeeping (reference counts, copy-on-write, reuse),
a GRPO group storing its prompt's KV once, preemption of the youngest sequences when the pool runs out (same
tokens, logprobs and versions as a pool that never runs out), and the model fields the engine refuses at load."""
from __future__ import annotations

import pytest
import torch

from areal_mq.engines.base import EngineRequest
from areal_mq.engines.torch.kvcache import PagedKVCache, blocks_for
from areal_mq.messages import SamplingSpec

from .test_torch_engine import greedy, run_all

pytestmark = pytest.mark.timeout(120)
PER_TOKEN = 2 * 2 * 2 * 16 * 4  # tiny-random-llama, float32: K+V x 2 layers x 2 KV heads x 16 dims x 4 bytes


def test_pool_bookkeeping_shares_copies_on_write_and_reuses_freed_blocks():
    cache = PagedKVCache(layers=2, num_blocks=6, block_size=4, kv_heads=1, head_dim=2, dtype=torch.float32)
    a: list[int] = []
    assert cache.ensure(a, 6) and a == [0, 1] and cache.used == 2
    cache.k[:, :, 1] = 7.0
    b = cache.share(a, 2)  # a second sequence on the same prompt blocks
    assert b == a and cache.refs[:2] == [2, 2] and cache.used == 2
    assert cache.writable(b, 6, 7)  # b writes position 6: block 1 is shared, so b gets a copy
    assert b[0] == a[0] and b[1] not in a and cache.copies == 1 and cache.refs[:2] == [2, 1]
    assert torch.equal(cache.k[:, :, b[1]], cache.k[:, :, 1])  # the copy holds the shared block's KV
    assert cache.writable(a, 6, 7) and a == [0, 1] and cache.copies == 1  # a is block 1's only user now
    assert not cache.ensure(a, 40) and a == [0, 1]  # more than the pool holds: nothing taken
    cache.release(b)
    assert b == [] and cache.refs[0] == 1 and cache.used == 2
    cache.release(a)
    assert cache.used == 0 and cache.peak_used == 3
    c: list[int] = []
    assert cache.ensure(c, 4) and c[0] in (0, 1, 2)  # freed blocks are handed out again before untouched ones


def test_a_group_of_eight_stores_its_prompt_kv_once(make_engine, prompts):
    engine = make_engine(max_concurrent=8, prefill_chunk_tokens=512)
    p = prompts[3]
    for k in range(8):
        engine.submit(EngineRequest(f"s{k}", p, SamplingSpec(temperature=1.0, max_new_tokens=6, seed=k)))
    bs = engine.cache.block_size
    prompt_blocks = blocks_for(len(p) - 1, bs)  # the last prompt token is fed by the first decode
    engine._admit()
    engine._prefill()
    assert engine.stats()["kv_blocks_used"] == prompt_blocks  # 8 block tables, one copy of the prompt's KV
    assert engine.counters["prefilled_tokens"] == len(p) - 1
    assert all(s.table == engine.rows[0].table for s in engine.rows)
    engine._decode()  # each sample writes its first token: the partial last prompt block is copied on write
    partial = (len(p) - 1) % bs != 0
    assert engine.stats()["kv_cow_copies"] == (7 if partial else 0)
    assert engine.stats()["kv_blocks_used"] == prompt_blocks + (7 if partial else 8)
    run_all(engine)
    alone = make_engine(max_concurrent=8, prefill_chunk_tokens=512, share_prefill=False)
    for k in range(8):
        alone.submit(EngineRequest(f"s{k}", p, SamplingSpec(temperature=1.0, max_new_tokens=6, seed=k)))
    alone._admit()
    alone._prefill()
    assert alone.stats()["kv_blocks_used"] == 8 * prompt_blocks


def _long_run(engine, prompts, n=60):
    for i, p in enumerate(prompts):
        engine.submit(EngineRequest(f"q{i}", p, SamplingSpec(temperature=1.0, max_new_tokens=n, ignore_eos=True, seed=i)))
    return run_all(engine)


def test_preempting_the_youngest_when_the_pool_runs_out_changes_no_output(make_engine, prompts):
    roomy = make_engine(max_concurrent=4)
    tight = make_engine(max_concurrent=4, kv_cache_bytes=PER_TOKEN * 16 * 13)  # 12 blocks: 192 of ~400 tokens
    want, got = _long_run(roomy, prompts), _long_run(tight, prompts)
    stats = tight.stats()
    assert stats["preempted"] > 0 and stats["preempted_tokens"] > 0 and roomy.stats()["preempted"] == 0
    assert stats["kv_blocks_used"] == 0 and stats["kv_blocks_peak"] <= 12
    for rid, out in want.items():
        assert got[rid].output_ids.tolist() == out.output_ids.tolist(), rid
        assert got[rid].versions.tolist() == out.versions.tolist()
        torch.testing.assert_close(torch.from_numpy(got[rid].logprobs), torch.from_numpy(out.logprobs),
                                   atol=1e-5, rtol=1e-5)


def test_preemption_takes_the_youngest_first(make_engine, prompts):
    engine = make_engine(max_concurrent=4, kv_cache_bytes=PER_TOKEN * 16 * 13)
    first_preempted = []
    original = engine.sched.preempt  # engines/scheduler.py decides; the engine drives it

    def record(seq):
        first_preempted.append((seq.request.request_id, sorted(s.order for s in engine.rows)[-1] == seq.order))
        original(seq)

    engine.sched.preempt = record
    _long_run(engine, prompts)
    assert first_preempted and all(youngest for _, youngest in first_preempted)
    assert first_preempted[0][0] != "q0"  # the oldest is never the first to go


def _model_with(tiny_model_dir, tmp_path, **fields):
    import json
    import shutil

    target = tmp_path / "model"
    shutil.copytree(tiny_model_dir, target)
    config = json.loads((target / "config.json").read_text())
    config.update(fields)
    (target / "config.json").write_text(json.dumps(config))
    return target


@pytest.mark.parametrize("fields, match", [
    ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 100000.0}}, "rope type 'dynamic'"),
    ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 100000.0, "short_factor": [1.0] * 8,
                          "long_factor": [2.0] * 8, "original_max_position_embeddings": 512}}, "rope type 'longrope'"),
], ids=["hidden_act", "rope_dynamic", "rope_longrope"])
def test_a_model_the_engine_does_not_compute_exactly_is_refused_at_load(tiny_model_dir, tiny_tokenizer, tmp_path,
                                                                        fields, match):
    from areal_mq.engines.config import EngineConfig
    from areal_mq.engines.torch.engine import TorchEngine
    from areal_mq.errors import ModelNotFound

    model_dir = _model_with(tiny_model_dir, tmp_path, **fields)
    with pytest.raises(ModelNotFound, match=match):
        TorchEngine(model_dir, EngineConfig(threads=1), dtype="float32", tokenizer=tiny_tokenizer)


def test_static_rope_scalings_are_accepted(hf_tiny):
    from types import SimpleNamespace

    from areal_mq.engines.torch.forward import check_computable

    for kind in ("default", "linear", "llama3", "yarn"):
        check_computable(SimpleNamespace(hidden_act="silu", rope_parameters={"rope_type": kind}))
    check_computable(hf_tiny.config)


def _mid_generation(engine, prompts, steps=4):
    for i, p in enumerate(prompts):
        engine.submit(EngineRequest(f"u{i}", p, SamplingSpec(temperature=1.0, max_new_tokens=12, ignore_eos=True, seed=i)))
    for _ in range(steps):
        engine.step()


def test_the_update_measures_the_logprob_gap_keep_leaves_and_changes_nothing(make_engine, prompts, hf_tiny):
    from .engine_refs import perturbed_state

    same = {k: v.detach().clone() for k, v in hf_tiny.named_parameters()}
    probe = make_engine(kv_on_update="keep", kv_gap_rows=2)
    _mid_generation(probe, prompts)
    unchanged = probe.update_weights(1, tensors=same)  # same weights: old KV = recomputed KV, up to summation order
    assert unchanged["gap_rows"] == 2 and unchanged["gap_logprob_max"] < 1e-4
    changed = probe.update_weights(2, tensors=perturbed_state(hf_tiny, seed=7, scale=0.05))
    assert changed["gap_rows"] == 2 and changed["gap_logprob_max"] > 1e-3 and changed["gap_kl_mean"] > 0
    assert probe.stats()["kv_blocks_used"] > 0  # the recomputed copies went back to the pool
    plain = make_engine(kv_on_update="keep")
    _mid_generation(plain, prompts)
    plain.update_weights(1, tensors=same)
    plain.update_weights(2, tensors=perturbed_state(hf_tiny, seed=7, scale=0.05))
    a, b = run_all(probe), run_all(plain)
    assert {k: v.output_ids.tolist() for k, v in a.items()} == {k: v.output_ids.tolist() for k, v in b.items()}


def test_recompute_runs_in_chunks_of_its_own_budget(make_engine, prompts, hf_tiny):
    from .engine_refs import perturbed_state

    state = perturbed_state(hf_tiny, seed=3)
    steps = {}
    for chunk in (0, 4096):
        engine = make_engine(prefill_chunk_tokens=16, recompute_chunk_tokens=chunk)
        _mid_generation(engine, prompts, steps=12)
        stale = engine.update_weights(1, tensors=state)["recompute_tokens"]
        n = 0
        while engine.stats()["ready"] < engine.stats()["running"]:
            engine.step()
            n += 1
        steps[chunk] = n
        assert stale > 16 * 4
    assert steps[4096] == 1 and steps[0] >= 4
