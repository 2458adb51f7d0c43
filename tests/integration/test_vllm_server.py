"""engine: vllm-server against a real vLLM OpenAI-compatible server process (CPU).

One server (float32 SmolLM2-135M, dev mode, scale-out routes, areal-mq worker extension) is started
for the module on a free loopback port and stopped by PID. Checks: token ids + logprobs + version
spans over /inference/v1/generate match a HF forward; a mid-generation update through /pause,
/collective_rpc, /reset_prefix_cache, /update_weight_version and /resume relabels the tokens after
it and they follow the new weights; /abort_requests returns the partial sequence; attaching to a
server without the required settings is a clear error.

Run: pytest -m vllm tests/integration/test_vllm_server.py  (needs bash docker/install-vllm.sh)
"""
from __future__ import annotations

import subprocess
import time
import urllib.request

import numpy as np
import pytest

pytest.importorskip("vllm", reason="vLLM not installed: bash docker/install-vllm.sh")

from areal_mq.engines.base import EngineRequest  # noqa: E402
from areal_mq.messages import SamplingSpec  # noqa: E402
from areal_mq.engines.config import EngineConfig  # noqa: E402
from areal_mq.engines.models import resolve_model  # noqa: E402
from areal_mq.engines.vllm.common import VllmError  # noqa: E402
from areal_mq.engines.vllm.server import VllmServerEngine, server_command, server_env  # noqa: E402

from .test_vllm_engine import ARGMAX_TOL, LOGPROB_TOL, PROMPT, run  # noqa: E402
from .vllm_reference import HFReference, perturbed_weights  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(1800)]
START_TIMEOUT_S = 1200


def free_port() -> int:
    from tests.integration.procs import free_ports  # below the ephemeral range, this xdist worker's slice

    return free_ports(1)[0]


@pytest.fixture(scope="module")
def model_dir():
    return resolve_model("smollm2-135m-instruct")


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    """A vLLM server process; yields its engine config; stopped by PID."""
    port = free_port()
    cfg = EngineConfig(kind="vllm-server", max_concurrent=4, seed=0,  # eager: test_vllm_engine.py says why
                       vllm={"server_url": f"http://127.0.0.1:{port}", "enforce_eager": True})
    log = open(tmp_path_factory.mktemp("server") / "vllm.log", "wb")
    proc = subprocess.Popen(server_command(str(model_dir), port, cfg, dtype="float32"), env=server_env(cfg),
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    started, deadline = time.monotonic(), time.monotonic() + START_TIMEOUT_S
    try:
        while True:
            assert proc.poll() is None, f"vLLM server exited with {proc.returncode}; see {log.name}"
            assert time.monotonic() < deadline, f"vLLM server not up in {START_TIMEOUT_S} s; see {log.name}"
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2).close()
                break
            except OSError:
                time.sleep(1)
        print(f"\nvLLM server up in {time.monotonic() - started:.1f} s")
        yield cfg
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
        log.close()


@pytest.fixture(scope="module")
def engine(server):
    eng = VllmServerEngine(server)
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def hf(model_dir):
    return HFReference(model_dir)


@pytest.fixture(scope="module")
def weights(model_dir, tmp_path_factory):
    from safetensors.torch import load_file

    b_dir = tmp_path_factory.mktemp("weights_b")
    return {"A": load_file(str(model_dir / "model.safetensors")), "B": perturbed_weights(model_dir, b_dir), "B_dir": b_dir}


def test_generate_tokens_logprobs_versions(engine, hf, weights):
    reqs = [EngineRequest(f"g{i}", list(PROMPT), SamplingSpec(temperature=t, max_new_tokens=20, seed=i))
            for i, t in enumerate((0.0, 0.8))]
    outs = run(engine, reqs)
    for r in reqs:
        out = outs[r.request_id]
        assert out.finish_reason in ("length", "stop") and "error" not in out.stats
        assert out.versions.tolist() == [engine.version] * len(out.output_ids)
        ref, _ = hf.logprobs(PROMPT, out.output_ids.tolist(), r.sampling.temperature, weights["A"])
        np.testing.assert_allclose(out.logprobs, ref, atol=LOGPROB_TOL)


def test_update_over_http_mid_generation(engine, hf, weights):
    v0 = engine.version
    timings = {}
    req = EngineRequest("u1", list(PROMPT), SamplingSpec(temperature=0.0, max_new_tokens=64))
    out = run(engine, [req], on_tokens=(6, lambda e: timings.update(
        e.update_weights(v0 + 1, path=str(weights["B_dir"]), kv_on_update="recompute"))))["u1"]
    k = int((out.versions == v0).sum())
    assert 0 < k < len(out.output_ids), out.versions
    assert out.versions.tolist() == [v0] * k + [v0 + 1] * (len(out.output_ids) - k)
    assert timings["tensors"] > 0 and timings["prefix_cache_reset"] == 1.0
    ids = out.output_ids.tolist()
    a_lp, _ = hf.logprobs(PROMPT, ids, 0.0, weights["A"])
    b_lp, b_best = hf.logprobs(PROMPT, ids, 0.0, weights["B"])
    np.testing.assert_allclose(out.logprobs[:k], a_lp[:k], atol=LOGPROB_TOL)
    np.testing.assert_allclose(out.logprobs[k:], b_lp[k:], atol=LOGPROB_TOL)
    assert (b_best[k:] - b_lp[k:] <= ARGMAX_TOL).all()
    engine.update_weights(v0 + 2, tensors=weights["A"])  # staged in /dev/shm, reloaded by path


def test_abort_and_pause_resume(engine):
    engine.submit(EngineRequest("long", list(PROMPT), SamplingSpec(temperature=1.0, max_new_tokens=400, seed=2)))
    base, deadline = engine.stats()["tokens_total"], time.monotonic() + 300
    while engine.stats()["tokens_total"] - base < 4:
        assert time.monotonic() < deadline
        engine.step()
    engine.pause()
    time.sleep(0.5)  # let chunks already on the wire arrive
    frozen = engine.stats()["tokens_total"]
    time.sleep(1.0)
    assert engine.stats()["tokens_total"] == frozen  # nothing generated while paused
    engine.resume()
    out = engine.abort("long")
    assert out is not None and out.finish_reason == "abort"
    assert 4 <= len(out.output_ids) < 400 and len(out.logprobs) == len(out.output_ids)
    assert not engine.has_work() and engine.abort("long") is None


def test_attach_errors_are_clear(server):
    bad = EngineConfig(kind="vllm-server", vllm={"server_url": f"http://127.0.0.1:{free_port()}"})
    with pytest.raises(VllmError, match="unreachable.*python -m areal_mq.engines.vllm.server"):
        VllmServerEngine(bad)
