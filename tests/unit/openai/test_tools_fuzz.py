"""Random tool-shaped bodies and replies through ChatService: every body ends in an answer or an ApiError (a 4xx),
never another exception (a 500), and every recorded turn stays exact.

Run: pytest tests/unit/openai/test_tools_fuzz.py -q   (~15 s, mostly loading the tokenizer)
"""
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from areal_mq.engines.models import load_tokenizer, resolve_model
from areal_mq.messages import GenerateResult
from areal_mq.openai.api import ApiError
from areal_mq.openai.server import ChatService, ServeConfig

MODEL = "tiny-random-llama"
JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=8),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
                    max_leaves=8)
NAME = st.sampled_from(["add", "add", "add", "search", "", "bad name", 3])
VALID_TOOL = st.builds(lambda n: {"type": "function", "function": {"name": n, "parameters": {"type": "object"}}},
                       st.sampled_from(["add", "search"]))
VALID_CALL = st.builds(lambda i, a: {"id": i, "type": "function", "function": {"name": "add", "arguments": a}},
                       st.sampled_from(["c1", "c2"]), st.sampled_from(['{"a": 1}', "{", "[]", '{"a":  1}']))
FN = st.fixed_dictionaries({"name": NAME}, optional={"arguments": st.sampled_from(['{"a": 1}', "{", "[]", 5]) | JSON,
                                                     "parameters": JSON, "description": JSON})
TOOL = st.one_of(VALID_TOOL, VALID_TOOL, VALID_TOOL, st.fixed_dictionaries({"type": st.sampled_from(["function", "x"]),
                                                                            "function": FN | JSON}), JSON)
CALL = st.one_of(VALID_CALL, VALID_CALL, VALID_CALL, st.fixed_dictionaries(
    {"id": st.sampled_from(["c1", "c2"]) | JSON, "type": st.just("function"), "function": FN | JSON}), JSON)
MESSAGE = st.one_of(
    st.fixed_dictionaries({"role": st.just("assistant"), "content": st.none() | st.text(max_size=20)},
                          optional={"tool_calls": st.lists(CALL, max_size=2)}),
    st.fixed_dictionaries({"role": st.just("tool"), "content": st.text(max_size=20),
                           "tool_call_id": st.one_of(st.just("c1"), st.just("c1"), st.just("c1"), JSON)}),
    st.fixed_dictionaries({"role": st.just("user"), "content": st.text(max_size=20)}))
CHOICE = st.one_of(st.sampled_from(["auto", "none", "required", "any"]), st.sampled_from(["auto", "required"]),
                   st.just({"type": "function", "function": {"name": "add"}}), st.fixed_dictionaries(
    {"type": st.just("function"), "function": st.fixed_dictionaries({"name": NAME})}), JSON)
REPLY = st.sampled_from(['<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>', "<tool_call>{", "plain",
                         '{"name": "add", "parameters": {}}', '<tool_call>{"name": "add", "arguments": "x"}'])


class Backend:
    def __init__(self, tokenizer):
        self.tok, self.text = tokenizer, "plain"

    def generate(self, prompt_ids, samplings, sessions, timeout_s):
        ids = list(self.tok(self.text, add_special_tokens=False)["input_ids"]) + [self.tok.eos_token_id]
        return [GenerateResult(output_ids=ids, logprobs=[-1.0] * len(ids), versions=[0] * len(ids),
                               finish_reason="stop", text=self.text) for _ in samplings]


@pytest.fixture(scope="module")
def svc():
    tok = load_tokenizer(resolve_model(MODEL))
    return ChatService(ServeConfig(max_context=1 << 16), MODEL, tok, Backend(tok))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(history=st.lists(MESSAGE, max_size=4), tools=st.one_of(st.none(), st.lists(TOOL, min_size=1, max_size=3),
                                                        st.lists(TOOL, min_size=1, max_size=3), JSON),
       choice=st.one_of(st.none(), st.none(), CHOICE), reply=REPLY, turns=st.integers(1, 3))
def test_tool_shaped_bodies_are_answered_or_refused_never_crash(svc, history, tools, choice, reply, turns):
    svc.backend.text = reply
    messages = [{"role": "user", "content": "hi"}, *history]
    body = {"model": MODEL, "messages": messages, "max_tokens": 8}
    if tools is not None:
        body["tools"] = tools
    if choice is not None:
        body["tool_choice"] = choice
    for _ in range(turns):
        try:
            r = svc.chat(body, "fz")
        except ApiError as exc:
            assert 400 <= exc.status < 500
            break
        msg = r["choices"][0]["message"]
        assert r["choices"][0]["finish_reason"] in ("stop", "tool_calls", "length")
        body["messages"] = [*body["messages"], msg, {"role": "user", "content": "more"}]
    doc = svc.episode("fz", pop=True) if svc.recorder.get("fz") else None
    if doc:
        assert doc["audit"]["exact_turns"] == doc["audit"]["turns"]
