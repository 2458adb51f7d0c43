"""Tool-call parsing per model family (areal_mq/openai/toolcalls.py) on hand-written replies.

Run: pytest tests/unit/openai/test_toolcalls.py -q   (< 1 s)
"""
import json

import pytest

from areal_mq.openai.toolcalls import FAMILIES, family_for, parse_llama3, parse_qwen


def calls(reply):
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in reply.tool_calls]


def test_qwen_calls_with_text_before_and_two_blocks():
    r = parse_qwen('Let me look.\n<tool_call>\n{"name": "search", "arguments": {"query": "x"}}\n</tool_call>\n'
                   '<tool_call>{"name":"python","arguments":"{\\"code\\": \\"print(1)\\"}"}</tool_call>')
    assert calls(r) == [("search", {"query": "x"}), ("python", {"code": "print(1)"})]
    assert r.content == "Let me look." and r.error == ""
    ids = [c["id"] for c in r.tool_calls]
    assert len(set(ids)) == 2 and all(i.startswith("call_") for i in ids)
    assert all(c["type"] == "function" for c in r.tool_calls)


def test_qwen_a_call_cut_before_its_closing_tag_is_read_and_plain_text_is_text():
    assert calls(parse_qwen('<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n')) == [("add", {"a": 1})]
    r = parse_qwen("The answer is 4.")
    assert r.content == "The answer is 4." and r.tool_calls == [] and r.error == ""


@pytest.mark.parametrize("text, why", [
    ('<tool_call>{"name": "add", "arguments": {"a": 1}</tool_call>', "not JSON"),
    ('<tool_call>["add"]</tool_call>', 'string "name"'),
    ('<tool_call>{"name": "add", "arguments": [1]}</tool_call>', "must be a JSON object"),
    ('<tool_call>{"name": "add", "arguments": "{oops"}</tool_call>', "not JSON"),
    ('ok <tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>{"name": 3}</tool_call>', "call 1"),
])
def test_qwen_malformed_calls_come_back_as_the_whole_text_with_a_reason(text, why):
    r = parse_qwen(text)
    assert r.tool_calls == [] and r.content == text
    assert r.error.startswith("malformed_tool_call") and why in r.error


def test_llama3_json_form_with_and_without_python_tag_and_several_calls():
    assert calls(parse_llama3('{"name": "add", "parameters": {"a": 1, "b": 2}}')) == [("add", {"a": 1, "b": 2})]
    r = parse_llama3('<|python_tag|>{"name": "a", "parameters": {"s": "x;y"}}')
    assert calls(r) == [("a", {"s": "x;y"})] and r.content is None
    assert calls(parse_llama3('{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"k": 1}}')) == [
        ("a", {}), ("b", {"k": 1})]
    assert parse_llama3("It is 3.").tool_calls == [] and parse_llama3("It is 3.").error == ""


def test_llama3_malformed():
    r = parse_llama3('{"name": "add", "parameters": {"a": 1')
    assert r.tool_calls == [] and "not JSON" in r.error
    assert "python_tag" in parse_llama3("<|python_tag|>print(1)").error


def test_family_from_the_template_and_forced_prefixes():
    assert family_for("{{ messages }}").name == "prompted"
    assert family_for("{% if tools %}<tool_call>{% endif %}").name == "qwen"
    assert family_for("{% if tools %}<|python_tag|>{% endif %}").name == "llama3"
    assert family_for("anything", "none").parse("<tool_call>{}</tool_call>").tool_calls == []
    with pytest.raises(ValueError, match="unknown tool-call family"):
        family_for("", "mistral")
    qwen = FAMILIES["qwen"]
    named = {"type": "function", "function": {"name": "add"}}
    assert qwen.forced("auto") == "" and qwen.forced("required") == "<tool_call>\n"
    forced = qwen.forced(named)
    assert calls(qwen.parse(forced + '{"a": 1}}\n</tool_call>')) == [("add", {"a": 1})]
    assert calls(FAMILIES["llama3"].parse(FAMILIES["llama3"].forced(named) + '{"a": 2}}')) == [("add", {"a": 2})]


def test_serve_config_takes_a_known_family_only():
    from types import SimpleNamespace

    from areal_mq.errors import ConfigError
    from areal_mq.openai.server import serve_config

    cfg = SimpleNamespace(rollout=SimpleNamespace(engine=SimpleNamespace(max_model_len=2048)))
    assert serve_config(cfg, "127.0.0.1", 0, tool_family="llama3").tool_family == "llama3"
    with pytest.raises(ConfigError, match="--tool-family"):
        serve_config(cfg, "127.0.0.1", 0, tool_family="hermes2")


CALC = [{"type": "function", "function": {"name": "calculator", "parameters": {
    "type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}},
        {"type": "function", "function": {"name": "add", "parameters": {
            "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}]


@pytest.mark.parametrize("text, want", [
    ('<tool_call>\n{"name": "calculator", "arguments": 18 + 64}\n</tool_call>', [("calculator", {"expression": "18 + 64"})]),
    ('<tool_call>\n{"name": "calculator", "arguments": "3 * (4 + 5)"}', [("calculator", {"expression": "3 * (4 + 5)"})]),
    ('<tool_call>{"name": "calculator", "arguments": 7 - 2</tool_call>', [("calculator", {"expression": "7 - 2"})]),
    ('<tool_call>{"name": "calculator", "arguments": {"expression": "1+1"}}</tool_call>\n'
     '<tool_call>{"name": "calculator", "arguments": 2 * 3}</tool_call>',
     [("calculator", {"expression": "1+1"}), ("calculator", {"expression": "2 * 3"})]),
])
def test_prompted_bare_reads_a_one_string_parameter_calls_bare_value(text, want):
    from areal_mq.openai.toolcalls import parse_reply

    reply = parse_reply(FAMILIES["prompted_bare"], text, CALC)
    assert calls(reply) == want and reply.error == "" and reply.repaired == sum(
        "{\"expression\"" not in b for b in text.split("<tool_call>")[1:])
    plain = parse_reply(FAMILIES["prompted"], text, CALC)  # the default families never do this
    assert plain.repaired == 0 and plain.error.startswith("malformed_tool_call")


@pytest.mark.parametrize("text", [
    '<tool_call>{"name": "add", "arguments": 1 + 2}</tool_call>',  # add has two integer parameters
    '<tool_call>{"name": "nosuch", "arguments": 1 + 2}</tool_call>',  # not a listed tool
    '<tool_call>{"name": "calculator", "arguments": {"expression": 1</tool_call>',  # a broken object is not bare
    '<tool_call>{"name": "calculator", "arguments": }</tool_call>',  # nothing there
    '<tool_call>{"name": "calculator", "arguments": "unterminated}</tool_call>',  # a broken JSON string
    '<tool_call>{"name": "calculator", "arguments": ' + "1+" * 1500 + "1}</tool_call>",  # over MAX_BARE_CHARS
    '<tool_call>{"name": "calculator", "arguments": 1 + 1}</tool_call><tool_call>not json</tool_call>',  # half
])
def test_prompted_bare_leaves_what_is_not_a_bare_argument_malformed(text):
    from areal_mq.openai.toolcalls import parse_reply

    reply = parse_reply(FAMILIES["prompted_bare"], text, CALC)
    assert reply.tool_calls == [] and reply.content == text and "malformed_tool_call" in reply.error
    assert reply.repaired == 0
    assert family_for("{{ messages }}").name == "prompted"  # auto never picks it


def test_each_family_says_where_a_streamed_call_opens():
    """The streamed reply holds text back from a family's `call_marker` (areal_mq/openai/streaming.py); the family
    owns it, so a new family cannot be missed by the stream. A marker is where the family's forced call opens, and
    a family without one (Llama's bare JSON) streams a reply with tools only whole."""
    for fam in FAMILIES.values():
        if fam.call_marker is not None:
            assert fam.required_prefix.startswith(fam.call_marker), fam.name
            assert fam.parse(f"hi {fam.call_marker}").content.startswith("hi"), fam.name
    assert {f.name for f in FAMILIES.values() if f.call_marker is None} == {"llama3", "none"}
