"""`stream: true` through the endpoint: the `openai` package with stream=True against a real HTTP server on a free
loopback port, the tiny model's real tokenizer, and a scripted backend passed in that streams its answer as the
rollout worker does (GeneratePartials of a few tokens, versions 3 then 4: a weight update mid-answer, one stream),
then the GenerateResult.

- the streamed content comes in several chunks whose concatenation is the non-streamed answer to the same
  request (multi-byte characters never split), and the episode records of both are identical;
- an agent written with `tools=` and `stream=True` (assembling tool_calls deltas as openai-package agents do)
  runs unchanged: tool call, tool result, final answer; its episode trains with per-token versions;
- a bad `stream` value or an unsupported stream option is a clear 400;
- TextStream never hands out half a character, a stop string's beginning or a tool call's opening.
Run: pytest tests/unit/openai/test_streaming.py -q   (~10 s, most of it loading the tokenizer)
"""
import asyncio
import json

import numpy as np
import pytest

from areal_mq.messages import GeneratePartial
from areal_mq.openai.streaming import TextStream
from areal_mq.tools.registry import ToolRegistry

from .test_tools_client import MODEL, AddTool, ScriptedBackend, Servers, tokenizer  # noqa: F401 (a fixture)

openai = pytest.importorskip("openai")  # the [test] extra has it


class StreamingBackend(ScriptedBackend):
    """ScriptedBackend that also streams: partials of `every` tokens (as a rollout worker sends them), then the
    result; the same script entry answers a stream or not."""

    every = 3

    def stream(self, prompt_ids, sampling, session, timeout_s):
        (result,) = self.generate(prompt_ids, [sampling], [session], timeout_s)
        n = len(result.output_ids)
        parts = [GeneratePartial(output_ids=result.output_ids[i:i + self.every],
                                 logprobs=result.logprobs[i:i + self.every], versions=result.versions[i:i + self.every],
                                 start=i, seq=k) for k, i in enumerate(range(0, n, self.every))]
        return iter(parts + [result])


@pytest.fixture
def serve(tokenizer):
    servers = Servers(tokenizer, StreamingBackend)

    def start(script):
        server, service = servers.start(script)
        return server, service, openai.OpenAI(base_url=server.url, api_key="x", max_retries=0, timeout=10)

    yield start
    servers.stop()


def _turn(doc):
    """An episode record's turns without what differs between two requests by nature (ids, times)."""
    return [{k: v for k, v in t.items() if k not in ("at", "id", "created")} for t in doc["turns"]]


def test_streamed_content_is_the_non_streamed_answer_in_several_chunks(serve):
    text = "Café ☕ costs 42 €, ça va? Ünïcödé ok."
    server, service, client = serve([text, text])
    user = [{"role": "user", "content": "Price?"}]
    plain = client.chat.completions.create(model=MODEL, messages=user, temperature=0, user="plain")
    events = list(client.chat.completions.create(model=MODEL, messages=user, temperature=0, user="streamed",
                                                 stream=True, stream_options={"include_usage": True}))
    assert events[0].choices[0].delta.role == "assistant"
    deltas = [e.choices[0].delta.content for e in events if e.choices and e.choices[0].delta.content]
    assert len(deltas) > 3 and "".join(deltas) == plain.choices[0].message.content == text
    assert all("\ufffd" not in d for d in deltas)
    assert events[-2].choices[0].finish_reason == "stop" and not events[-1].choices
    assert events[-1].usage.completion_tokens == plain.usage.completion_tokens
    assert len({e.id for e in events}) == 1
    a, b = service.recorder.get("plain").to_json(), service.recorder.get("streamed").to_json()
    assert _turn(a) == _turn(b) and a["audit"] == b["audit"]  # the same record, stream or not


def agent(client, registry: ToolRegistry, question: str, episode: str) -> tuple[str, list]:
    """Plain OpenAI-client agent code with stream=True: assemble the deltas, call tools until the model answers."""
    messages = [{"role": "user", "content": question}]
    for _ in range(4):
        content, calls, reason = "", {}, None
        for ev in client.chat.completions.create(model=MODEL, messages=messages, tools=registry.openai_tools(),
                                                 user=episode, stream=True):
            delta = ev.choices[0].delta
            content += delta.content or ""
            for tc in delta.tool_calls or []:
                call = calls.setdefault(tc.index, {"id": "", "type": "function",
                                                   "function": {"name": "", "arguments": ""}})
                call["id"] = tc.id or call["id"]
                call["function"]["name"] += tc.function.name or ""
                call["function"]["arguments"] += tc.function.arguments or ""
            reason = ev.choices[0].finish_reason or reason
        msg = {"role": "assistant", "content": content or None}
        if calls:
            msg["tool_calls"] = [calls[i] for i in sorted(calls)]
        messages.append(msg)
        if reason != "tool_calls":
            return content, messages
        for call in msg["tool_calls"]:
            result = asyncio.run(registry.dispatch(call))
            messages.append(result.to_message(call["id"]))
    raise AssertionError("the agent never got an answer")


def test_a_streamed_tools_agent_runs_unchanged_and_its_episode_trains(serve):
    server, service, client = serve(['Let me add.\n<tool_call>\n{"name":"add","arguments":{"a":17,"b":25}}\n'
                                     '</tool_call>', "The answer is 42."])
    answer, messages = agent(client, ToolRegistry([AddTool()]), "What is 17 + 25?", "agent-s")
    assert answer == "The answer is 42."
    assert messages[1]["content"] == "Let me add."  # the call's opening was never streamed as content
    (call,) = messages[1]["tool_calls"]
    assert call["function"]["name"] == "add" and json.loads(call["function"]["arguments"]) == {"a": 17, "b": 25}
    assert call["id"].startswith("call_") and messages[2]["content"] == "42"
    ep = service.recorder.pop("agent-s")
    doc = ep.to_json()
    assert doc["single_sequence"] and doc["audit"]["exact_turns"] == 2
    gen = [s for s in ep.to_segments() if s["kind"] == "generated"]
    assert [s["tokens"] for s in gen] == [t.choices[0].output_ids.tolist() for t in ep.turns]
    assert all(s["versions"][-2:] == [4, 4] and s["versions"][0] == 3 for s in gen)  # per-token versions


@pytest.mark.parametrize("extra,param", [({"stream": "yes"}, "stream"), ({"stream": 1}, "stream"),
                                         ({"stream": True, "stream_options": {"chunk_size": 4}}, "stream_options"),
                                         ({"stream": True, "stream_options": {"include_usage": "y"}},
                                          "stream_options"),
                                         ({"stream_options": {"include_usage": True}}, "stream_options"),
                                         ({"stream": True, "n": 2}, "n"), ({"stream": True, "logprobs": True},
                                                                          "logprobs")])
def test_stream_parameters_are_validated(serve, extra, param):
    server, service, client = serve([])
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], extra_body=extra)
    assert err.value.body["param"] == param and err.value.body["message"]


def _bytes_stream(**kw) -> TextStream:
    return TextStream(lambda ids: bytes(ids).decode("utf-8", errors="replace"), **kw)


def _feed(ts: TextStream, data: bytes, every: int = 1) -> list[str]:
    out = []
    for i in range(0, len(data), every):
        ids = list(data[i:i + every])
        out.append(ts.feed(GeneratePartial(output_ids=ids, logprobs=[0.0] * len(ids), versions=[0] * len(ids),
                                           start=i, seq=i)))
    return out


def test_text_stream_holds_back_what_may_still_change():
    ts = _bytes_stream()
    out = _feed(ts, "a☕b".encode())
    assert out == ["a", "", "", "☕", "b"] and ts.finish("a☕b") == ("", True)
    ts = _bytes_stream(stops=["STOP"])
    assert "".join(_feed(ts, b"go STx")) == "go STx"  # "ST" then "x": not the stop string after all
    ts = _bytes_stream(stops=["STOP"])
    assert "".join(_feed(ts, b"go STOP and more")) == "go " and ts.finish("go ") == ("", True)
    ts = _bytes_stream(call_marker="<tool_call>")
    assert "".join(_feed(ts, b'Hi.\n<tool_call>\n{"name"')) == "Hi."
    ts = _bytes_stream(hold_all=True)
    assert _feed(ts, b"abc", every=3) == [""] and ts.finish("abc") == ("abc", True)
    assert np.array_equal(ts.ids, list(b"abc"))
