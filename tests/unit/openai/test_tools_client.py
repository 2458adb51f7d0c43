"""An agent written with the `openai` package's `tools=` runs unchanged against the endpoint: a real HTTP server on a
free loopback port, the tiny model's real tokenizer (SmolLM2's template: the `prompted` tool family), a scripted
backend passed in, and the tool answered by areal_mq's ToolRegistry. Tool call, tool result, final answer; the
episode is one sequence whose trained tokens are the generated ids with their per-token versions. A malformed call
comes back as text (finish_reason stop) with the reason in the episode record.

Run: pytest tests/unit/openai/test_tools_client.py -q   (~10 s, most of it loading the tokenizer)
"""
import asyncio
import json
import threading

import pytest

from areal_mq.engines.models import load_tokenizer, resolve_model
from areal_mq.messages import GenerateResult
from areal_mq.openai.server import ChatService, OpenAIServer, ServeConfig
from areal_mq.tools.base import ToolResult
from areal_mq.tools.registry import ToolRegistry

openai = pytest.importorskip("openai")  # the [test] extra has it

MODEL = "tiny-random-llama"


class AddTool:
    name, description = "add", "Add two integers."
    parameters = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                  "required": ["a", "b"]}

    async def call(self, arguments: dict) -> ToolResult:
        return ToolResult(self.name, True, str(arguments["a"] + arguments["b"]))


class ScriptedBackend:
    """Answers with the next scripted text's token ids + the end-of-turn token; versions 3 then 4 (an update)."""

    def __init__(self, tokenizer, script):
        self.tok, self.script, self.prompts = tokenizer, list(script), []

    def generate(self, prompt_ids, samplings, sessions, timeout_s):
        self.prompts.append(list(prompt_ids))
        text = self.script.pop(0)
        ids = list(self.tok(text, add_special_tokens=False)["input_ids"]) + [self.tok.eos_token_id]
        versions = [3] * (len(ids) - 2) + [4, 4]
        return [GenerateResult(output_ids=ids, logprobs=[-0.5] * len(ids), versions=versions, finish_reason="stop",
                               text=text)]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(resolve_model(MODEL))


class Servers:
    """Endpoints on threads, each serving `backend(tokenizer, script)`; `stop()` ends them all (the fixtures of
    this file and of test_streaming.py)."""

    def __init__(self, tokenizer, backend):
        self.tokenizer, self.backend, self.started = tokenizer, backend, []

    def start(self, script):
        service = ChatService(ServeConfig(port=0), MODEL, self.tokenizer, self.backend(self.tokenizer, script))
        server = OpenAIServer(service)
        thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        thread.start()
        self.started.append((server, thread))
        return server, service

    def stop(self):
        for server, thread in self.started:
            server.shutdown()
            server.server_close()
            thread.join(5)


@pytest.fixture
def serve(tokenizer):
    servers = Servers(tokenizer, ScriptedBackend)
    yield servers.start
    servers.stop()


def agent(base_url: str, registry: ToolRegistry, question: str, episode: str) -> tuple[str, list]:
    """Plain OpenAI-client agent code: call tools until the model answers."""
    client = openai.OpenAI(base_url=base_url, api_key="x", max_retries=0, timeout=10)
    messages = [{"role": "user", "content": question}]
    for _ in range(4):
        r = client.chat.completions.create(model=MODEL, messages=messages, tools=registry.openai_tools(), user=episode)
        msg = r.choices[0].message
        messages.append(msg)
        if r.choices[0].finish_reason != "tool_calls":
            return msg.content, messages
        for call in msg.tool_calls:
            result = asyncio.run(registry.dispatch(call.model_dump()))
            messages.append(result.to_message(call.id))
    raise AssertionError("the agent never got an answer")


def test_an_openai_tools_agent_runs_unchanged_and_its_episode_trains(serve, tokenizer):
    server, service = serve(['Let me add.\n<tool_call>\n{"name":"add","arguments":{"a":17,"b":25}}\n</tool_call>',
                             "The answer is 42."])
    answer, messages = agent(server.url, ToolRegistry([AddTool()]), "What is 17 + 25?", "agent-1")
    assert answer == "The answer is 42."
    call = messages[1].tool_calls[0]
    assert messages[1].content == "Let me add." and call.function.name == "add"
    assert json.loads(call.function.arguments) == {"a": 17, "b": 25} and messages[2]["content"] == "42"
    first, second = service.backend.prompts
    assert '"name": "add"' in tokenizer.decode(first)  # the tools reached the model (system message)
    ep = service.recorder.pop("agent-1")
    doc = ep.to_json()
    assert doc["single_sequence"] and doc["audit"]["exact_turns"] == 2
    assert doc["turns"][0]["choices"][0]["tool_calls"] == 1
    assert doc["turns"][1]["origin"] == "continued"
    segs = ep.to_segments()
    assert [s["kind"] for s in segs] == ["prompt", "generated", "env", "generated"]
    gen = [s for s in segs if s["kind"] == "generated"]
    assert [s["tokens"] for s in gen] == [t.choices[0].output_ids.tolist() for t in ep.turns]
    assert all(s["versions"][-2:] == [4, 4] and s["versions"][0] == 3 for s in gen)  # per-token versions
    assert "<tool_response>\n42\n</tool_response>" in tokenizer.decode(segs[2]["tokens"])  # the result: env tokens
    assert second[:len(first) + len(gen[0]["tokens"])] == first + gen[0]["tokens"]


def test_a_malformed_call_is_text_with_the_reason_recorded(serve):
    server, service = serve(['<tool_call>{"name": "add", "arguments": {"a": 1</tool_call>'])
    client = openai.OpenAI(base_url=server.url, api_key="x", max_retries=0, timeout=10)
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "1 + 1?"}],
                                       tools=ToolRegistry([AddTool()]).openai_tools(), user="bad")
    assert r.choices[0].finish_reason == "stop" and r.choices[0].message.tool_calls is None
    assert r.choices[0].message.content.startswith("<tool_call>")
    choice = service.recorder.get("bad").turns[0].choices[0]
    assert choice.tool_calls == 0 and "malformed_tool_call" in choice.tool_error and "not JSON" in choice.tool_error


def test_tools_are_validated(serve):
    server, _ = serve([])
    client = openai.OpenAI(base_url=server.url, api_key="x", max_retries=0, timeout=10)
    user = [{"role": "user", "content": "hi"}]
    tools = ToolRegistry([AddTool()]).openai_tools()
    for kw, param in [({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools[0]"),
                      ({"tools": tools, "tool_choice": {"type": "function", "function": {"name": "mul"}}},
                       "tool_choice"),
                      ({"tool_choice": "required"}, "tool_choice"),
                      ({"tools": tools * 65}, "tools"), ({"tools": ["add"]}, "tools[0]"),
                      ({"tools": tools, "tool_choice": {"type": "function", "function": {"name": ["add"]}}},
                       "tool_choice")]:
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model=MODEL, messages=user, **kw)
        assert err.value.body["param"] == param
    with pytest.raises(openai.BadRequestError) as err:  # a tool result must say which call it answers
        client.chat.completions.create(model=MODEL, messages=user + [{"role": "tool", "content": "3"}], tools=tools)
    assert err.value.body["param"] == "messages[1].tool_call_id"


def test_the_calculator_agent_forces_its_first_call_and_prompted_bare_reads_the_bare_expression(tokenizer):
    """areal_mq/workflows/calculator_agent.py solve_first_call against an endpoint with tool_family prompted_bare:
    the named tool_choice puts the call's opening in the prompt, the model's bare `18 + 64}` is read as
    {"expression": "18 + 64"}, the calculator answers 82, the final reply is the answer; the record counts the
    repair and the trained tokens stay the generated ones."""
    from types import SimpleNamespace

    from areal_mq.workflows import calculator_agent

    service = ChatService(ServeConfig(port=0, tool_family="prompted_bare"), calculator_agent.MODEL, tokenizer,
                          ScriptedBackend(tokenizer, ["18 + 64}\n", "18 + 64 = 82. The answer is \\boxed{82}."]))
    server = OpenAIServer(service)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        client = openai.OpenAI(base_url=server.url, api_key="x", max_retries=0, timeout=10,
                               default_headers={"X-Episode-Id": "calc-1"})
        answer = calculator_agent.solve_first_call(client, SimpleNamespace(prompt="What is 18 + 64?"))
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)
    assert answer == "18 + 64 = 82. The answer is \\boxed{82}."
    first, second = service.backend.prompts
    assert tokenizer.decode(first).endswith('<tool_call>\n{"name": "calculator", "arguments": ')
    assert "<tool_response>\n82\n</tool_response>" in tokenizer.decode(second)
    ep = service.recorder.pop("calc-1")
    choice = ep.turns[0].choices[0]
    assert choice.tool_calls == 1 and choice.tool_repairs == 1 and choice.tool_error == ""
    assert ep.to_json()["turns"][0]["choices"][0]["tool_repairs"] == 1
    gen = [s["tokens"] for s in ep.to_segments() if s["kind"] == "generated"]
    assert gen == [t.choices[0].output_ids.tolist() for t in ep.turns]  # trained = generated, whatever was parsed
