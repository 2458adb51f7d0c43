"""engine: vllm-server against a stand-in vLLM server (http.server on a free loopback port, no vLLM needed):

- the engine built for a rollout worker decodes completion text with the model's tokenizer (it was built
  without one, so every text was "" and every group uniform);
- a broken stream (dropped connection, no finish_reason; an error chunk) ends as an output the rollout
  worker answers as an error, while a sound stream is a result.
Run: pytest tests/unit/engines/test_vllm_server_stream.py -q
"""
from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from areal_mq.config import load_config
from areal_mq.engines import build_engine
from areal_mq.engines.base import EngineRequest
from areal_mq.messages import SamplingSpec
from areal_mq.engines.config import EngineConfig
from areal_mq.engines.vllm.worker import EXTENSION_CLS
from areal_mq.workers.rollout import broken_output

TOKENS = [504, 3458, 314, 260, 1345]  # SmolLM2 ids of a few ordinary words


class FakeVllm(BaseHTTPRequestHandler):
    """/health, /server_info, /update_weight_version, and /inference/v1/generate whose stream depends on
    the request id: "ok-*" streams TOKENS and finishes, "drop-*" stops after two tokens without a
    finish_reason, "err-*" sends an error chunk."""

    protocol_version = "HTTP/1.1"  # as uvicorn: the stream is chunked on a keep-alive connection

    def log_message(self, *args):
        pass

    def _chunk(self, data: bytes):
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))

    def _json(self, obj):
        body = json.dumps(obj).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        if self.path.startswith("/server_info"):
            self._json({"vllm_config": {"parallel_config": {"worker_extension_cls": EXTENSION_CLS},
                                        "model_config": {"logprobs_mode": "processed_logprobs",
                                                         "max_model_len": 2048}}})
        else:
            self._json({})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
        if self.path != "/inference/v1/generate":
            return self._json({})
        rid = body["request_id"]
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        n = 2 if rid.startswith("drop") else len(TOKENS)
        for i, tok in enumerate(TOKENS[:n]):
            last = i == len(TOKENS) - 1
            choice = {"token_ids": [tok], "logprobs": {"content": [{"logprob": -0.5}]},
                      "finish_reason": "stop" if last else None,
                      "weight_versions": [{"version": "0", "start": 0, "end": len(TOKENS)}] if last else None}
            self._chunk(f"data: {json.dumps({'choices': [choice]})}\n\n".encode())
        if rid.startswith("err"):
            self._chunk(b'data: {"error": "engine dead"}\n\n')
        if not rid.startswith("drop"):  # a dropped stream ends without its last chunk
            self._chunk(b"data: [DONE]\n\n")
            self.wfile.write(b"0\r\n\r\n")
        self.close_connection = True


@pytest.fixture(scope="module")
def server_url():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), FakeVllm)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


@pytest.fixture(scope="module")
def engine(server_url):
    cfg = load_config(None, ["model.name=tiny-random-llama"])
    eng = build_engine(EngineConfig(kind="vllm-server", max_concurrent=4, vllm={"server_url": server_url}),
                       cfg.model, seed=0)  # as rollout.main builds it: no tokenizer passed
    yield eng
    eng.close()


def _run(engine, rid):
    engine.submit(EngineRequest(rid, [1, 2, 3], SamplingSpec(temperature=1.0, max_new_tokens=8)))
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        for out in engine.step():
            if out.request_id == rid:
                return out
    raise AssertionError(f"no output for {rid}")


def test_completion_text_is_decoded_with_the_models_tokenizer(engine):
    from areal_mq.engines.models import load_tokenizer, resolve_model

    out = _run(engine, "ok-1")
    want = load_tokenizer(resolve_model("tiny-random-llama")).decode(TOKENS, skip_special_tokens=True)
    assert want.strip() and out.text == want
    assert out.finish_reason == "stop" and out.versions.tolist() == [0] * len(TOKENS)
    assert broken_output(out) is None


@pytest.mark.parametrize("rid, words", [("drop-1", "without a finish_reason"), ("err-1", "engine dead")])
def test_a_broken_stream_is_an_error_for_the_rollout_worker(engine, rid, words):
    out = _run(engine, rid)
    assert out.finish_reason == "abort" and words in out.stats["error"]
    assert words in broken_output(out)
