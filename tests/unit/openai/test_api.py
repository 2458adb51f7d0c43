"""The OpenAI endpoint's HTTP layer without a broker: a real server on a free loopback port, the real tiny-model
tokenizer, and a stand-in backend passed in. Validation answers 4xx with OpenAI error JSON; the server survives.

Run: pytest tests/unit/test_openai_api.py -q   (~5 s)
"""
import http.client
import json
import socket
import threading

import numpy as np
import pytest

from areal_mq.engines.models import load_tokenizer, resolve_model
from areal_mq.messages import GenerateResult
from areal_mq.openai.api import ApiError, ApiLimits, parse_chat
from areal_mq.openai.server import ChatService, OpenAIServer, ServeConfig

openai = pytest.importorskip("openai")  # the [test] extra has it; an image without it (the GPU machine) skips these

MODEL = "tiny-random-llama"
USER = [{"role": "user", "content": "What is 2 + 3?"}]


class SeededBackend:
    """Answers each sampling with its seed's tokens; records what it was asked."""

    def __init__(self, error: ApiError | None = None):
        self.calls, self.error = [], error

    def generate(self, prompt_ids, samplings, sessions, timeout_s):
        self.calls.append((list(prompt_ids), samplings, sessions))
        if self.error:
            raise self.error
        return [GenerateResult(output_ids=[28, 29], logprobs=[-0.25, -1.5], versions=[2, 3], finish_reason="stop",
                               text=f"five{i}") for i, _ in enumerate(samplings)]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(resolve_model(MODEL))


def start(tokenizer, backend, **cfg):
    service = ChatService(ServeConfig(port=0, **cfg), MODEL, tokenizer, backend)
    server = OpenAIServer(service)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    return server, thread


@pytest.fixture
def endpoint(tokenizer):
    backend = SeededBackend()
    server, thread = start(tokenizer, backend)
    yield server, backend
    server.shutdown()
    server.server_close()
    thread.join(5)


def raw(server, method, path, body=b"", headers=None):
    host, port = server.server_address[:2]
    conn = http.client.HTTPConnection(host, port, timeout=10)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read())
    finally:
        conn.close()


def client(server, **kw):
    return openai.OpenAI(base_url=server.url, api_key=kw.pop("api_key", "x"), max_retries=0, timeout=10)


def test_round_trip_with_the_official_client_records_the_episode(endpoint, tokenizer):
    server, backend = endpoint
    r = client(server).chat.completions.create(model=MODEL, messages=USER, n=2, logprobs=True, seed=7,
                                               max_tokens=5, temperature=0.5, stop=["\n"], user="ep-1")
    assert [c.message.content for c in r.choices] == ["five0", "five1"]
    assert r.choices[0].logprobs.content[1].logprob == pytest.approx(-1.5)
    prompt, samplings, sessions = backend.calls[0]
    text = tokenizer.apply_chat_template(USER, tokenize=False, add_generation_prompt=True)  # the model's template
    assert tokenizer.decode(prompt) == text and text.endswith("<|im_start|>assistant\n")
    assert [s.seed for s in samplings] == [7, 8] and samplings[0].max_new_tokens == 5
    assert samplings[0].stop_strings == ["\n"] and samplings[0].temperature == 0.5
    assert sessions == ["ep-1", ""]
    assert r.usage.prompt_tokens == len(prompt) and r.usage.completion_tokens == 4
    ep = server.service.recorder.pop("ep-1")
    assert ep.turns[0].choices[1].versions.tolist() == [2, 3]


@pytest.mark.parametrize("body, status, param", [
    ({"model": MODEL}, 400, "messages"),
    ({"model": MODEL, "messages": "hi"}, 400, "messages"),
    ({"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}, 400, "messages[0].role"),
    ({"model": MODEL, "messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content"),
    ({"messages": USER}, 400, "model"),
    ({"model": "gpt-4", "messages": USER}, 404, "model"),
    ({"model": MODEL, "messages": USER, "max_tokens": 10 ** 6}, 400, "max_tokens"),
    ({"model": MODEL, "messages": USER, "max_tokens": "10"}, 400, "max_tokens"),
    ({"model": MODEL, "messages": USER, "temperature": -1}, 400, "temperature"),
    ({"model": MODEL, "messages": USER, "n": 100}, 400, "n"),
    ({"model": MODEL, "messages": USER, "stream": "yes"}, 400, "stream"),
    ({"model": MODEL, "messages": USER, "logprobs": True, "top_logprobs": 3}, 400, "top_logprobs"),
    ({"model": MODEL, "messages": USER, "tools": [{"type": "function"}]}, 400, "tools[0]"),
    ({"model": MODEL, "messages": USER, "user": "../../etc/passwd"}, 400, "user"),
    ([1, 2], 400, None),
])
def test_bad_requests_get_openai_errors(endpoint, body, status, param):
    server, backend = endpoint
    code, doc = raw(server, "POST", "/v1/chat/completions", json.dumps(body).encode(),
                    {"Content-Type": "application/json"})
    assert code == status and doc["error"]["param"] == param and doc["error"]["message"]
    assert set(doc["error"]) == {"message", "type", "param", "code"} and not backend.calls


def test_malformed_and_oversized_bodies_and_unknown_routes(endpoint):
    server, _ = endpoint
    assert raw(server, "POST", "/v1/chat/completions", b"{not json")[0] == 400
    assert raw(server, "POST", "/v1/chat/completions", b"\xff\xfe")[0] == 400
    assert raw(server, "POST", "/v1/chat/completions", b"[" * 500_000)[0] == 400  # nesting bomb
    # one byte over the limit, and 8 MB (more than the loopback socket buffers hold): the server answers 413
    # without parsing, then reads and drops the body, so a client still writing it reads the 413 instead of
    # a broken pipe (without the drain the 8 MB request failed every time)
    for size in ((1 << 20) + 1, 8 << 20):
        status, doc = raw(server, "POST", "/v1/chat/completions", b" " * size)
        assert status == 413 and doc["error"]["code"] == "request_too_large"
    assert raw(server, "GET", "/etc/passwd")[0] == 404
    assert raw(server, "GET", "/v1/episodes/nobody")[0] == 404
    assert raw(server, "DELETE", "/v1/episodes/..%2F..")[0] == 404
    models = client(server).models.list()
    assert [m.id for m in models.data] == [MODEL]


def test_a_too_long_prompt_is_refused_before_the_broker(tokenizer):
    backend = SeededBackend()
    server, thread = start(tokenizer, backend, max_context=64)
    try:
        with pytest.raises(openai.BadRequestError, match="exceeds the context"):
            client(server).chat.completions.create(model=MODEL, messages=USER, max_tokens=60)
        assert not backend.calls
    finally:
        server.shutdown(), server.server_close(), thread.join(5)


def test_backend_errors_pass_through_and_a_slow_client_does_not_stop_the_server(tokenizer):
    down = ApiError(503, "the job broker is not answering", None, "broker_unavailable", "server_error")
    server, thread = start(tokenizer, SeededBackend(down), read_timeout_s=0.5)
    try:
        idle = socket.create_connection(server.server_address[:2])  # says nothing: cut at the read timeout
        with pytest.raises(openai.InternalServerError) as info:
            client(server).chat.completions.create(model=MODEL, messages=USER)
        assert info.value.status_code == 503 and "not answering" in str(info.value)
        idle.settimeout(5)
        assert idle.recv(100) == b""  # closed by the server
        idle.close()
    finally:
        server.shutdown(), server.server_close(), thread.join(5)


def test_an_api_key_is_checked_when_set(tokenizer):
    server, thread = start(tokenizer, SeededBackend(), api_key="s3cret")
    try:
        with pytest.raises(openai.AuthenticationError):
            client(server, api_key="wrong").models.list()
        assert client(server, api_key="s3cret").models.list().data[0].id == MODEL
    finally:
        server.shutdown(), server.server_close(), thread.join(5)


def test_sampling_mapping_without_a_server():
    call = parse_chat({"model": "m", "messages": [{"role": "developer", "content": [{"type": "text", "text": "a"}]},
                                                  {"role": "user", "content": "b"}],
                       "max_completion_tokens": 9, "max_tokens": 3, "top_p": 0.9}, ApiLimits(), "m", "hdr-ep")
    assert call.messages[0] == {"role": "system", "content": "a"}
    assert call.samplings[0].max_new_tokens == 9 and call.samplings[0].top_p == 0.9
    assert call.episode_id == "hdr-ep" and call.samplings[0].seed is None
