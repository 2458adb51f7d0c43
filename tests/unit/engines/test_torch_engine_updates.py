"""Interruptible weight updates of the TorchEngine: versions per token, recompute vs keep, sources
(tensors / safetensors dir), and refused updates that leave the old weights serving."""
from __future__ import annotations

import pytest
import torch

from areal_mq.engines.base import EngineRequest
from areal_mq.messages import SamplingSpec
from areal_mq.errors import WeightsLoadError

from .engine_refs import full_logprobs, greedy_continue, greedy_keep_kv, model_with, perturbed_state
from .test_torch_engine import greedy, run_all

pytestmark = pytest.mark.timeout(180)
BEFORE, AFTER = 6, 10  # tokens generated under version 0, then under version 1


@pytest.fixture(scope="module")
def new_state(hf_tiny):
    return perturbed_state(hf_tiny, seed=99)


@pytest.fixture(scope="module")
def hf_new(hf_tiny, new_state):
    return model_with(hf_tiny, new_state)


def generate_with_update(engine, prompts, sampling, chunk=None, **update):
    """Submit, step BEFORE times, update to version 1, run to the end. The caller's engine must admit
    every prompt in one step (prefill_chunk_tokens >= total prompt tokens: see `engine_for`)."""
    for i, p in enumerate(prompts):
        engine.submit(EngineRequest(f"u{i}", p, sampling))
    outs = {}
    for _ in range(BEFORE):  # every request is admitted in step 1, so each has BEFORE tokens now
        for out in engine.step():
            outs[out.request_id] = out
    assert not outs
    if chunk is not None:
        engine.cfg = engine.cfg.model_copy(update={"prefill_chunk_tokens": chunk})
    timings = engine.update_weights(1, **update)
    outs.update(run_all(engine))
    return outs, timings


def engine_for(make_engine, **overrides):
    return make_engine(prefill_chunk_tokens=512, **overrides)


@pytest.mark.parametrize("chunk", [256, 16])
def test_recompute_update_mid_generation(make_engine, hf_tiny, hf_new, new_state, prompts, chunk):
    engine = engine_for(make_engine, kv_on_update="recompute")
    # admission uses one full prefill; the recompute after the update is chunked (16: over several steps)
    outs, timings = generate_with_update(engine, prompts, greedy(BEFORE + AFTER, ignore_eos=True),
                                         chunk=chunk, tensors=new_state)
    assert {"load_s", "pause_s"} <= set(timings) and timings["recompute_tokens"] > 0
    changed = 0
    for i, p in enumerate(prompts):
        out = outs[f"u{i}"].output_ids.tolist()
        assert outs[f"u{i}"].versions.tolist() == [0] * BEFORE + [1] * AFTER
        assert out[:BEFORE] == greedy_continue(hf_tiny, p, BEFORE)
        assert out[BEFORE:] == greedy_continue(hf_new, p + out[:BEFORE], AFTER)  # new weights, full context
        changed += out[BEFORE:] != greedy_continue(hf_tiny, p + out[:BEFORE], AFTER)
        ref = torch.cat([full_logprobs(hf_tiny, p, out)[:BEFORE], full_logprobs(hf_new, p, out)[BEFORE:]])
        torch.testing.assert_close(torch.from_numpy(outs[f"u{i}"].logprobs), ref, atol=2e-4, rtol=1e-4)
    assert changed == len(prompts)  # the update really changed what was generated


def test_sampled_logprobs_after_recompute_update(make_engine, hf_tiny, hf_new, new_state, prompts):
    engine = engine_for(make_engine, kv_on_update="recompute")
    sp = SamplingSpec(temperature=0.8, top_p=0.9, max_new_tokens=BEFORE + AFTER, ignore_eos=True, seed=5)
    outs, _ = generate_with_update(engine, prompts[:2], sp, tensors=new_state)
    for i, p in enumerate(prompts[:2]):
        out = outs[f"u{i}"].output_ids.tolist()
        ref = torch.cat([full_logprobs(hf_tiny, p, out, 0.8)[:BEFORE], full_logprobs(hf_new, p, out, 0.8)[BEFORE:]])
        torch.testing.assert_close(torch.from_numpy(outs[f"u{i}"].logprobs), ref, atol=2e-4, rtol=1e-4)


def test_keep_update_reuses_old_kv(make_engine, hf_tiny, hf_new, new_state, prompts):
    keep = engine_for(make_engine, kv_on_update="keep")
    kept, timings = generate_with_update(keep, prompts, greedy(BEFORE + AFTER, ignore_eos=True), tensors=new_state)
    assert timings["recompute_tokens"] == 0
    recompute = engine_for(make_engine, kv_on_update="recompute")
    recomputed, _ = generate_with_update(recompute, prompts, greedy(BEFORE + AFTER, ignore_eos=True),
                                         tensors=new_state)
    differ = 0
    for i, p in enumerate(prompts):
        out = kept[f"u{i}"].output_ids.tolist()
        assert kept[f"u{i}"].versions.tolist() == [0] * BEFORE + [1] * AFTER
        assert out[BEFORE:] == greedy_keep_kv(hf_tiny, hf_new, p + out[:BEFORE], AFTER)
        differ += not torch.allclose(torch.from_numpy(kept[f"u{i}"].logprobs[BEFORE:]),
                                     torch.from_numpy(recomputed[f"u{i}"].logprobs[BEFORE:]), atol=1e-3)
    assert differ > 0  # stale KV gives different logits than recomputed KV


def test_update_from_safetensors_dir_equals_tensor_update(make_engine, new_state, prompts, tmp_path):
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in new_state.items()}, str(tmp_path / "model.safetensors"))
    sp = greedy(BEFORE + AFTER, ignore_eos=True)
    a, _ = generate_with_update(engine_for(make_engine), prompts[:2], sp, path=str(tmp_path))
    b, _ = generate_with_update(engine_for(make_engine), prompts[:2], sp, tensors=new_state)
    assert all(a[k].output_ids.tolist() == b[k].output_ids.tolist() for k in b)


def test_waiting_requests_start_under_the_new_version(make_engine, new_state, prompts):
    engine = engine_for(make_engine, max_concurrent=1)
    engine.submit(EngineRequest("first", prompts[0], greedy(4, ignore_eos=True)))
    engine.submit(EngineRequest("second", prompts[1], greedy(4, ignore_eos=True)))
    engine.step()
    engine.update_weights(3, tensors=new_state)
    outs = run_all(engine)
    assert outs["first"].versions.tolist() == [0, 3, 3, 3]
    assert outs["second"].versions.tolist() == [3, 3, 3, 3]
    assert engine.stats()["version"] == 3


def _broken_updates(new_state, tmp_path):
    name = next(iter(new_state))
    missing = dict(new_state)
    missing.pop(name)
    wrong_shape = dict(new_state)
    wrong_shape[name] = torch.zeros(3, 3)
    unknown = dict(new_state)
    unknown["model.layers.99.mlp.up_proj.weight"] = torch.zeros(2)
    corrupt = tmp_path / "bad.safetensors"
    corrupt.write_bytes(b"not a safetensors file")
    return [
        (dict(tensors=missing), "misses 1 parameters"),
        (dict(tensors=wrong_shape), "wrong shapes"),
        (dict(tensors=unknown), "does not have"),
        (dict(path=str(corrupt)), "cannot read weights"),
        (dict(path=str(tmp_path / "empty_dir_or_missing")), "no safetensors"),
        (dict(), "exactly one of"),
        (dict(tensors=new_state, path=str(corrupt)), "exactly one of"),
    ]


def test_refused_updates_change_nothing(make_engine, new_state, prompts, tmp_path):
    baseline = engine_for(make_engine)
    baseline.submit(EngineRequest("a", prompts[0], greedy(8, ignore_eos=True)))
    expected = run_all(baseline)["a"].output_ids.tolist()
    engine = engine_for(make_engine)
    for kwargs, match in _broken_updates(new_state, tmp_path):
        with pytest.raises(WeightsLoadError, match=match):
            engine.update_weights(1, **kwargs)
    assert engine.version == 0
    engine.submit(EngineRequest("a", prompts[0], greedy(8, ignore_eos=True)))
    assert run_all(engine)["a"].output_ids.tolist() == expected


def test_chunked_recompute_lets_short_rows_decode_first(make_engine, new_state, prompts):
    engine = engine_for(make_engine, kv_on_update="recompute")
    for i, p in enumerate(prompts):
        engine.submit(EngineRequest(f"u{i}", p, greedy(30, ignore_eos=True)))
    for _ in range(3):
        engine.step()
    engine.cfg = engine.cfg.model_copy(update={"prefill_chunk_tokens": 24})
    engine.update_weights(1, tensors=new_state)
    seen = []
    while engine.stats()["ready"] < engine.stats()["running"]:
        engine.step()
        seen.append((engine.stats()["ready"], engine.stats()["running"]))
    assert any(0 < ready < running for ready, running in seen)  # decoding resumed before recompute ended


def test_shared_prefill_never_mixes_kv_of_different_weights(make_engine, new_state, prompts):
    # keep mode: rows prefilled partly under v0 keep that KV after the update; the same prompt submitted
    # after the update must not copy it (its KV history differs): it must answer as under v1 alone
    sp = greedy(8, ignore_eos=True)
    engine = make_engine(prefill_chunk_tokens=4, kv_on_update="keep")
    for k in range(2):
        engine.submit(EngineRequest(f"old{k}", prompts[0], sp))
    engine.step()  # 4 prompt tokens of the old rows now have v0 KV (the second row copied the first's)
    engine.update_weights(1, tensors=new_state)
    for k in range(2):
        engine.submit(EngineRequest(f"new{k}", prompts[0], sp))
    outs = {k: v.output_ids.tolist() for k, v in run_all(engine).items()}
    fresh = make_engine(prefill_chunk_tokens=4)
    fresh.update_weights(1, tensors=new_state)
    fresh.submit(EngineRequest("v1", prompts[0], sp))
    assert outs["new0"] == outs["new1"] == run_all(fresh)["v1"].output_ids.tolist()
    assert outs["old0"] == outs["old1"]  # identical histories share
    assert outs["old0"] != outs["new0"]  # the old rows' v0 prefix KV really mattered
    assert engine.counters["shared_prefill_tokens"] > 0
