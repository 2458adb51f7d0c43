"""engine: vllm against real vLLM (CPU) and an independent Hugging Face forward pass.

One engine (float32, SmolLM2-135M) is shared by the module: each vLLM start costs 0.5-4 min here.
Weights A are the model's own, weights B a seeded perturbation of every decoder projection.

Checks: behaviour logprobs equal log_softmax(logits / T) of a HF forward over the same tokens;
a mid-generation update stamps tokens before with v and after with v+1 (vLLM's spans agree with
the engine's own stamps), and the tokens after follow weights B — with the KV recomputed
("recompute") or kept from A ("keep"), each matching its own HF reference; the prefix cache does
not serve blocks from old weights; an in-memory update crosses vLLM's RPC in buckets, writes no file and
switches versions at the same point, staged (buckets made ready while decoding, the pause only for the swap) or
serial, every token before the switch following the old weights; the CPU default dtype is float32; abort returns
the partial sequence; a bad model path is a clear error within a deadline.

Run: pytest -m vllm tests/integration/test_vllm_engine.py  (needs bash docker/install-vllm.sh)
"""
from __future__ import annotations

import time

import numpy as np
import pytest

pytest.importorskip("vllm", reason="vLLM not installed: bash docker/install-vllm.sh")

from areal_mq.engines.base import EngineOutput, EngineRequest  # noqa: E402
from areal_mq.messages import SamplingSpec  # noqa: E402
from areal_mq.engines.config import EngineConfig  # noqa: E402
from areal_mq.engines.models import resolve_model  # noqa: E402
from areal_mq.engines.vllm.common import VllmError  # noqa: E402
from areal_mq.engines.vllm.engine import VllmEngine  # noqa: E402
from areal_mq.errors import ModelNotFound  # noqa: E402

from .vllm_reference import HFReference, perturbed_weights  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(1800)]

PROMPT = [1, 9690, 314, 253, 1789, 7018, 30, 3249, 314]  # a fixed token prompt (any ids in the vocab work)
LOGPROB_TOL = 2e-3  # float32 vLLM CPU kernels vs HF eager attention
ARGMAX_TOL = 1e-3  # a greedy token may lose to another only by a tie this close


@pytest.fixture(scope="module")
def model_dir():
    return resolve_model("smollm2-135m-instruct")


@pytest.fixture(scope="module")
def weights(model_dir, tmp_path_factory):
    from safetensors.torch import load_file

    a = load_file(str(model_dir / "model.safetensors"))
    b_dir = tmp_path_factory.mktemp("weights_b")
    return {"A": a, "B": perturbed_weights(model_dir, b_dir), "B_dir": b_dir}


@pytest.fixture(scope="module")
def hf(model_dir):
    return HFReference(model_dir)


@pytest.fixture(scope="module")
def shm_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("shm")


@pytest.fixture(scope="module")
def engine(model_dir, shm_dir):
    # 64 MiB buckets: an in-memory update of SmolLM2 (float32, ~540 MB) crosses vLLM's RPC in several messages;
    # shm_dir is where the old path staged files: it must stay empty
    # enforce_eager: these tests check our engine code (updates, aborts, parity), which is the same compiled or
    # eager; eager starts in ~27 s instead of ~50-57 s here. The compiled default (vLLM's torch.compile of the
    # model) is started by test_export_vllm.py, the one test here of what a user's run starts
    cfg = EngineConfig(kind="vllm", max_concurrent=4, seed=0,
                       vllm={"kv_cache_space_gib": 1, "start_timeout_s": 1200, "weight_bucket_mb": 64,
                             "shm_dir": str(shm_dir), "enforce_eager": True})
    eng = VllmEngine(cfg, model_dir)  # no dtype: the CPU default, model.dtype's float32 (the parity below needs it)
    print(f"\nvLLM engine started in {eng.start_s:.1f} s")
    yield eng
    eng.close()


def run(engine, requests, on_tokens=None, timeout=600) -> dict[str, EngineOutput]:
    """Submit, step until all finish; call on_tokens(engine) once when >= its threshold tokens exist."""
    base = engine.stats()["tokens_total"]
    for r in requests:
        engine.submit(r)
    outs, deadline = {}, time.monotonic() + timeout
    while engine.has_work():
        assert time.monotonic() < deadline, "generation did not finish in time"
        if on_tokens and engine.stats()["tokens_total"] - base >= on_tokens[0]:
            on_tokens[1](engine)
            on_tokens = None
        for out in engine.step():
            outs[out.request_id] = out
    return outs


def greedy(rid, n=48, ignore_eos=False):
    return EngineRequest(rid, list(PROMPT), SamplingSpec(temperature=0.0, max_new_tokens=n, ignore_eos=ignore_eos))


def restore_a(engine, weights, version):
    engine.update_weights(version, tensors=weights["A"])  # in memory: bytes through vLLM's RPC, no file


def check_follows(hf, out, temperature, weights_fn):
    """Every token's logprob matches the HF reference; greedy tokens are (near-)argmax there."""
    ref, best = weights_fn(out)
    np.testing.assert_allclose(out.logprobs, ref, atol=LOGPROB_TOL)
    if temperature == 0:
        assert (best - ref <= ARGMAX_TOL).all(), np.nonzero(best - ref > ARGMAX_TOL)


def test_logprobs_match_hf_forward(engine, hf, weights):
    reqs = [EngineRequest(f"s{i}", list(PROMPT[: 5 + i]), SamplingSpec(temperature=t, max_new_tokens=24, seed=i))
            for i, t in enumerate((0.7, 1.0, 1.3, 0.0))]
    outs = run(engine, reqs)
    for r in reqs:
        out = outs[r.request_id]
        assert out.finish_reason in ("length", "stop") and len(out.output_ids) > 0
        assert out.versions.tolist() == [engine.version] * len(out.output_ids)
        check_follows(hf, out, r.sampling.temperature,
                      lambda o: hf.logprobs(r.prompt_ids, o.output_ids.tolist(), r.sampling.temperature, weights["A"]))


def test_update_recompute_mid_generation(engine, hf, weights):
    v0 = engine.version
    before = run(engine, [greedy("a0")])["a0"]
    timings = {}
    out = run(engine, [greedy("r1", 64)], on_tokens=(6, lambda e: timings.update(
        e.update_weights(v0 + 1, path=str(weights["B_dir"]), kv_on_update="recompute"))))["r1"]
    k = int((out.versions == v0).sum())
    assert 0 < k < len(out.output_ids), out.versions
    assert out.versions.tolist() == [v0] * k + [v0 + 1] * (len(out.output_ids) - k)
    assert np.array_equal(out.stats["own_versions"], out.versions)  # vLLM's spans == our stamps
    assert engine.stats()["version_mismatches"] == 0
    assert timings["tensors"] > 0 and timings["prefix_cache_reset"] == 1.0
    print(f"\nupdate from a path ({timings['tensors']:.0f} tensors): load {timings['load_s']:.2f} s, "
          f"total {timings['total_s']:.2f} s")
    ids = out.output_ids.tolist()
    a_lp, _ = hf.logprobs(PROMPT, ids, 0.0, weights["A"])
    b_lp, b_best = hf.logprobs(PROMPT, ids, 0.0, weights["B"])
    np.testing.assert_allclose(out.logprobs[:k], a_lp[:k], atol=LOGPROB_TOL)
    np.testing.assert_allclose(out.logprobs[k:], b_lp[k:], atol=LOGPROB_TOL)  # KV recomputed under B
    assert (b_best[k:] - b_lp[k:] <= ARGMAX_TOL).all()  # the new weights pick the tokens
    # A new request with the same prompt: weights B, not prefix blocks cached under A.
    after = run(engine, [greedy("b0")])["b0"]
    assert after.versions.tolist() == [v0 + 1] * len(after.output_ids)
    assert after.output_ids.tolist() != before.output_ids.tolist()
    check_follows(hf, after, 0.0, lambda o: hf.logprobs(PROMPT, o.output_ids.tolist(), 0.0, weights["B"]))
    restore_a(engine, weights, v0 + 2)
    again = run(engine, [greedy("a1")])["a1"]
    assert again.output_ids.tolist() == before.output_ids.tolist()


def test_the_cpu_default_dtype_is_the_models_float32(engine):
    import torch

    assert engine.dtype == "float32" and engine._llm.model_config.dtype == torch.float32


@pytest.mark.parametrize("mode", ["staged", "serial"])
def test_in_memory_update_mid_generation_goes_through_vllms_rpc(engine, hf, weights, shm_dir, mode):
    """update_weights(tensors=...) packs the tensors into buckets of raw bytes and sends them with collective_rpc;
    nothing is written (shm_dir stays empty), every tensor arrives, the version switches at one token, every token
    before it follows the old weights and every token after it the new ones. staged: the buckets are made ready in
    the worker while the request keeps decoding (those tokens must still be the old version's, exactly), and
    generation pauses only for the swap; serial: the pause holds the whole transfer."""
    v0 = engine.version
    engine.vcfg.weight_update = mode
    timings = {}
    try:
        # long enough to outlast the staging (seconds here) so that the switch falls inside the request
        out = run(engine, [greedy("m1-" + mode, 400, ignore_eos=True)], on_tokens=(6, lambda e: timings.update(
            e.update_weights(v0 + 1, tensors=weights["B"], kv_on_update="recompute"))))["m1-" + mode]
    finally:
        engine.vcfg.weight_update = "staged"
    assert timings["buckets"] > 1 and timings["tensors"] == len(weights["B"]), timings
    assert not list(shm_dir.iterdir())
    k = int((out.versions == v0).sum())
    assert 0 < k < len(out.output_ids), out.versions
    assert out.versions.tolist() == [v0] * k + [v0 + 1] * (len(out.output_ids) - k)
    assert np.array_equal(out.stats["own_versions"], out.versions)
    assert engine.stats()["version_mismatches"] == 0
    ids = out.output_ids.tolist()
    a_lp, _ = hf.logprobs(PROMPT, ids, 0.0, weights["A"])
    b_lp, b_best = hf.logprobs(PROMPT, ids, 0.0, weights["B"])
    np.testing.assert_allclose(out.logprobs[:k], a_lp[:k], atol=LOGPROB_TOL)  # staging left the old weights live
    np.testing.assert_allclose(out.logprobs[k:], b_lp[k:], atol=LOGPROB_TOL)
    assert (b_best[k:] - b_lp[k:] <= ARGMAX_TOL).all()
    print(f"\n{mode} in-memory update of {len(weights['B'])} tensors in {timings['buckets']:.0f} buckets: "
          f"{k} tokens of the old version, paused {timings['paused_s']:.2f} s, total {timings['total_s']:.2f} s")
    restore_a(engine, weights, v0 + 2)
    again = run(engine, [greedy("m2-" + mode)])["m2-" + mode]
    check_follows(hf, again, 0.0, lambda o: hf.logprobs(PROMPT, o.output_ids.tolist(), 0.0, weights["A"]))


def test_update_keep_continues_on_stale_kv(engine, hf, weights):
    v0 = engine.version
    out = run(engine, [greedy("k1", 64)], on_tokens=(6, lambda e: e.update_weights(
        v0 + 1, path=str(weights["B_dir"]), kv_on_update="keep")))["k1"]
    k = int((out.versions == v0).sum())
    assert 0 < k < len(out.output_ids), out.versions
    assert np.array_equal(out.stats["own_versions"], out.versions)
    ids = out.output_ids.tolist()
    keep_lp, keep_best = hf.logprobs(PROMPT, ids, 0.0, weights["A"], switch_weights=weights["B"], switch_at=k)
    np.testing.assert_allclose(out.logprobs, keep_lp, atol=LOGPROB_TOL)
    assert (keep_best[k:] - keep_lp[k:] <= ARGMAX_TOL).all()
    recomputed, _ = hf.logprobs(PROMPT, ids, 0.0, weights["B"])
    assert np.abs(out.logprobs[k:] - recomputed[k:]).max() > 10 * LOGPROB_TOL  # the kept KV really is stale
    restore_a(engine, weights, v0 + 2)


def test_abort_returns_partial_tokens(engine):
    engine.submit(EngineRequest("long", list(PROMPT), SamplingSpec(temperature=1.0, max_new_tokens=400, seed=1)))
    base, deadline = engine.stats()["tokens_total"], time.monotonic() + 300
    while engine.stats()["tokens_total"] - base < 4:
        assert time.monotonic() < deadline
        assert engine.step() == []
    out = engine.abort("long")
    assert out is not None and out.finish_reason == "abort"
    assert 4 <= len(out.output_ids) < 400
    assert len(out.logprobs) == len(out.versions) == len(out.output_ids)
    assert not engine.has_work() and engine.abort("long") is None and engine.abort("never-submitted") is None


def test_bad_model_path_is_a_clear_error(tmp_path, model_dir):
    cfg = EngineConfig(kind="vllm", vllm={"start_timeout_s": 600})
    with pytest.raises(ModelNotFound, match="no config.json"):
        VllmEngine(cfg, tmp_path / "nowhere")
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in model_dir.iterdir():
        if not f.name.endswith(".safetensors"):
            (broken / f.name).write_bytes(f.read_bytes())
    with pytest.raises(ModelNotFound, match="no weights"):
        VllmEngine(cfg, broken)
    (broken / "model.safetensors").write_bytes(b"\x10\x00not a safetensors file")  # vLLM must fail, not hang
    started = time.monotonic()
    with pytest.raises(VllmError, match="failed to start"):
        VllmEngine(cfg, broken)
    assert time.monotonic() - started < 600
