"""Tools inside a workflow: `<tool_call>` parsing, answer_call's error results, and tool_episode end to end on a
scripted model (areal_mq.testing.ScriptedModel) graded by the real arith task.
Run: pytest tests/unit/tools/test_workflow.py -q   (~3 s, most of it the tokenizer)
"""
from __future__ import annotations

import asyncio
import json

from areal_mq.data.loaders import Problem
from areal_mq.messages import SamplingSpec
from areal_mq.testing import ScriptedModel
from areal_mq.tools import SAMPLE_CORPUS, SearchTool, ToolRegistry, answer_call, load_corpus, pending_tool_call
from areal_mq.tools.workflow import tool_episode, tools_prompt
from areal_mq.workflows.context import EpisodeContext
from areal_mq.workflows.local import LocalRewards
from areal_mq.workflows.runner import run_episode
from tests.unit.tools.test_registry import Echo

PROBLEM = Problem("q2", "How tall is the Harrowgate lighthouse tower, in metres?", "31")
SEARCH = ('<tool_call>\n{"name": "search", "arguments": {"query": "Harrowgate lighthouse tower metres", "k": 1}}\n'
          "</tool_call>")


def registry() -> ToolRegistry:
    return ToolRegistry([SearchTool(load_corpus(SAMPLE_CORPUS)), Echo()])


def test_pending_tool_call():
    assert pending_tool_call("I will look it up. " + SEARCH) == \
        '{"name": "search", "arguments": {"query": "Harrowgate lighthouse tower metres", "k": 1}}'
    assert pending_tool_call('<tool_call>{"name": "echo"') == '{"name": "echo"'  # stopped before the close tag
    assert pending_tool_call(SEARCH + "\n<tool_response>\n...\n</tool_response>\nSo") is None
    assert pending_tool_call("no call, \\boxed{3}") is None


def test_answer_call_never_raises():
    reg = registry()
    ok = asyncio.run(answer_call(reg, '{"name": "echo", "arguments": {"text": "hi"}}'))
    assert ok.ok and ok.output == "hi"
    as_string = asyncio.run(answer_call(reg, json.dumps({"name": "echo", "arguments": json.dumps({"text": "s"})})))
    assert as_string.output == "s"
    for body, reason in [('{"name": "echo", "arguments": {"text": ', "bad_arguments"), ('["echo"]', "bad_arguments"),
                         ('{"arguments": {}}', "bad_arguments"), ('{"name": "rm", "arguments": {}}', "unknown_tool"),
                         ('{"name": "echo", "arguments": {"text": 1}}', "bad_arguments"),
                         ('{"name": "echo", "arguments": "{oops"}', "bad_arguments"),
                         ('"' + "x" * 40_000 + '"', "arguments_too_large")]:
        r = asyncio.run(answer_call(reg, body))
        assert not r.ok and r.reason == reason, (body[:50], r)


def context(tokenizer, texts) -> EpisodeContext:
    return EpisodeContext(PROBLEM, [1, 2, 3], tokenizer, ScriptedModel(tokenizer, texts, rewards=LocalRewards()),
                          sampling=SamplingSpec(max_new_tokens=64), episode_id="ep-t")


def test_tool_episode_searches_and_answers(tiny_tokenizer):
    ctx = context(tiny_tokenizer, [SEARCH, "The tower is \\boxed{31} metres."])
    outcome = asyncio.run(run_episode(lambda c, p: tool_episode(c, p, registry(), names=["search"]), ctx, PROBLEM, 10))
    assert outcome.error is None and outcome.seq.reward == 1.0
    assert ctx.info["tool_calls"] == 1 and ctx.info["tool_errors"] == 0 and ctx.info["correct_at"] == 1
    seq = outcome.seq
    env = tiny_tokenizer.decode(seq.output_ids[seq.loss_mask == 0])
    assert env.startswith("\n<tool_response>\n[1] Harrowgate lighthouse (id harrowgate-lighthouse")
    assert "The tower is 31 metres tall" in env and env.endswith("</tool_response>\n")
    requests = ctx.backend.requests
    assert requests[0].sampling.stop_strings == ["</tool_call>"]
    assert requests[1].sampling.stop_strings == ["</tool_call>"]  # max_calls (3) not reached: it may call again
    prompt = tiny_tokenizer.decode(requests[0].prompt_ids)
    assert '"name": "search"' in prompt and '"name": "echo"' not in prompt  # only the offered tool is listed


def test_tool_episode_reports_bad_calls_to_the_model_and_stops_at_max_calls(tiny_tokenizer):
    texts = ['<tool_call>{"name": "echo", "arguments": {"text": "x"}}</tool_call>',  # registered, not offered
             "<tool_call>{broken</tool_call>", "\\boxed{30}"]
    ctx = context(tiny_tokenizer, texts)
    episode = lambda c, p: tool_episode(c, p, registry(), names=["search"], max_calls=2)  # noqa: E731
    outcome = asyncio.run(run_episode(episode, ctx, PROBLEM, 10))
    assert outcome.error is None and outcome.seq.reward == 0.0 and outcome.turns == 3
    assert ctx.info["tool_calls"] == 2 and ctx.info["tool_errors"] == 2
    env = tiny_tokenizer.decode(outcome.seq.output_ids[outcome.seq.loss_mask == 0])
    assert "error (unknown_tool): no tool named 'echo'; available: search" in env
    assert "error (bad_arguments): a tool call must be JSON" in env
    assert ctx.backend.requests[2].sampling.stop_strings != ["</tool_call>"]  # the last turn may not call


def test_tools_prompt_comes_from_the_registry():
    text = tools_prompt(registry())
    assert all(json.dumps(t["function"]) in text for t in registry().openai_tools())
