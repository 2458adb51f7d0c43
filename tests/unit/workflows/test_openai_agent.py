"""The `openai_agent` workflow: an agent written with the real `openai` client, unchanged, trains through a real
ChatService + OpenAIServer (loopback, free port) whose turns go to the episode's ctx.backend (a ScriptedModel with
the tiny model's tokenizer: SmolLM2's template, the `prompted` tool family). The shipped calculator agent's tool
call, tool result and final answer become ctx.episode token for token; an agent that raises, hangs, returns no text,
edits its history, calls past agent.max_turns, uses another episode id or is not importable fails its episode with
the reason, and the same endpoint serves the next episode.
Run: pytest tests/unit/workflows/test_openai_agent.py -q
"""
import asyncio
import subprocess
import sys
import time

import numpy as np
import pytest

from areal_mq.data.loaders import Problem
from areal_mq.engines.models import load_tokenizer, resolve_model
from areal_mq.errors import ConfigError
from areal_mq.messages import SamplingSpec
from areal_mq.testing import ScriptedModel
from areal_mq.workflows.context import EpisodeContext
from areal_mq.workflows.local import LocalRewards
from areal_mq.workflows.runner import load_workflow, run_episode

pytest.importorskip("openai")  # the [test] extra has it
from areal_mq.workflows.openai_agent import PROCESS_ENDPOINTS, AgentEndpoint, require_openai, run_agent  # noqa: E402

AGENTS = "tests.unit.workflows.openai_agents"
CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "17 + 25"}}\n</tool_call>'


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(resolve_model("tiny-random-llama"))


@pytest.fixture(scope="module")
def endpoint(tokenizer):
    ep = AgentEndpoint(tokenizer)
    yield ep
    ep.close()


def episode(tokenizer, endpoint, agent, script, episode_id="ep-1", timeout_s=20.0, args=None, **kw):
    problem = Problem("p1", "What is 17 + 25?", "42")
    model = ScriptedModel(tokenizer, script, rewards=LocalRewards())
    ctx = EpisodeContext(problem, [1, 2, 3], tokenizer, model, sampling=SamplingSpec(temperature=0.7, seed=5),
                         episode_id=episode_id, group_id="g7", sample_index=2, min_version=3,
                         args={"agent": agent, **(args or {})}, **kw)
    flow = (lambda c, p: run_agent(c, p, endpoint)) if endpoint is not None else load_workflow("openai_agent")
    outcome = asyncio.run(run_episode(flow, ctx, problem, timeout_s))
    return outcome, ctx, model


def test_the_calculator_agent_trains_its_tool_call_result_and_answer(tokenizer, endpoint):
    outcome, ctx, model = episode(tokenizer, endpoint, "areal_mq.workflows.calculator_agent:solve",
                                  [CALL, "17 + 25 = 42. The answer is \\boxed{42}."], max_tokens=1024)
    assert outcome.error is None and outcome.seq.reward == 1.0
    assert ctx.info == {"chat_calls": 2, "correct_at": 1, "tool_calls": 1, "tool_errors": 0, "tool_repairs": 0,
                        "exact_turns": 2, "continued_turns": 1}
    assert not set(ctx.info) & {"episode", "turns", "reward", "tokens", "seconds"}  # agent.episode_done's own keys
    first, second = model.requests
    for k, req in enumerate(model.requests):  # the episode's identity and the run's sampling, per turn
        assert (req.session, req.group_id, req.sample_index, req.min_version) == ("ep-1", "g7", 2, 3)
        assert req.sampling.temperature == 0.7 and req.sampling.stop_strings == ["</tool_call>"]
        assert req.sampling.max_new_tokens == 64 and req.sampling.seed == (5 + 7919 * k) & 0x7FFFFFFF
    seq = outcome.seq
    gen1 = tokenizer.encode(CALL, add_special_tokens=False)
    gen2 = tokenizer.encode("17 + 25 = 42. The answer is \\boxed{42}.", add_special_tokens=False)
    assert seq.prompt_ids.tolist() == first.prompt_ids.tolist()  # the first prompt: context, never trained
    n_env = len(seq.output_ids) - len(gen1) - len(gen2)
    assert seq.output_ids.tolist() == gen1 + second.prompt_ids.tolist()[len(first.prompt_ids) + len(gen1):] + gen2
    assert seq.loss_mask.tolist() == [1] * len(gen1) + [0] * n_env + [1] * len(gen2)
    assert seq.versions.tolist() == [2] * len(gen1) + [-1] * n_env + [2] * len(gen2)
    assert np.allclose(seq.logprobs[seq.loss_mask == 1], -0.1) and not seq.logprobs[seq.loss_mask == 0].any()
    env = tokenizer.decode(seq.output_ids[len(gen1):len(gen1) + n_env])
    assert "<tool_response>\n42\n</tool_response>" in env  # the calculator's answer: environment tokens
    assert '"name": "calculator"' in tokenizer.decode(first.prompt_ids)  # the tool was offered
    assert endpoint.recorder.get("ep-1") is None and endpoint.bridge.open_episodes() == 0  # nothing left behind


def test_no_tools_arm_an_async_agent_and_a_streaming_one(tokenizer, endpoint):
    outcome, ctx, model = episode(tokenizer, endpoint, "areal_mq.workflows.calculator_agent:solve_no_tools",
                                  ["It is \\boxed{41}."], episode_id="ep-2")
    assert outcome.error is None and outcome.seq.reward == 0.0 and ctx.info["tool_calls"] == 0
    assert "calculator" not in tokenizer.decode(model.requests[0].prompt_ids)
    outcome, ctx, _ = episode(tokenizer, endpoint, f"{AGENTS}:answers_async", ["\\boxed{42}"], episode_id="ep-3")
    assert outcome.error is None and outcome.seq.reward == 1.0 and ctx.info["chat_calls"] == 1
    outcome, ctx, _ = episode(tokenizer, endpoint, f"{AGENTS}:streams", ["So \\boxed{42}"], episode_id="ep-3s")
    assert outcome.error is None and outcome.seq.reward == 1.0 and ctx.info["exact_turns"] == 1


def test_a_malformed_call_is_text_and_a_bad_expression_an_answer(tokenizer, endpoint):
    bad = '<tool_call>{"name": "calculator", "arguments": {"expression": "17 +'
    outcome, ctx, _ = episode(tokenizer, endpoint, "areal_mq.workflows.calculator_agent:solve", [bad], "ep-4")
    assert outcome.error is None and ctx.info["tool_errors"] == 1 and ctx.info["tool_calls"] == 0
    assert outcome.seq.reward <= 0.0
    wrong = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "import os"}}\n</tool_call>'
    outcome, ctx, model = episode(tokenizer, endpoint, "areal_mq.workflows.calculator_agent:solve",
                                  [wrong, "\\boxed{42}"], "ep-5")
    assert outcome.error is None and outcome.seq.reward == 1.0 and ctx.info["tool_calls"] == 1
    assert "<tool_response>\nerror: not an arithmetic expression" in tokenizer.decode(model.requests[1].prompt_ids)


@pytest.mark.parametrize("agent, script, why", [
    (f"{AGENTS}:raises", [], "raised ValueError: the agent's own bug"),
    (f"{AGENTS}:returns_none", ["hi"], "returned NoneType, not its answer text"),
    (f"{AGENTS}:makes_no_call", [], "made no chat completion"),
    (f"{AGENTS}:edits_history", ["one", "two"], "not one sequence, turn 1: edited_history (message 0)"),
    (f"{AGENTS}:calls_forever", [CALL] * 3, "call 3 exceeds agent.max_turns (2)"),
    (f"{AGENTS}:other_episode", [], "no running episode 'someone-else'"),
    (f"{AGENTS}:asks_two_choices", [], "n must be 1"),
    ("no_such_module:solve", [], "ConfigError: agent.workflow_args.agent 'no_such_module:solve': cannot import 'no_such_module'"),
    (f"{AGENTS}:NOT_AN_AGENT", [], "is a int, not a function"),
    (None, [], "openai_agent needs agent.workflow_args.agent"),
])
def test_bad_agents_fail_their_episode_with_the_reason(tokenizer, endpoint, agent, script, why):
    outcome, _, _ = episode(tokenizer, endpoint, agent, script, "ep-bad", max_turns=2)
    assert outcome.seq is None and why in outcome.error, outcome.error
    assert endpoint.recorder.get("ep-bad") is None and endpoint.bridge.open_episodes() == 0
    outcome, _, _ = episode(tokenizer, endpoint, f"{AGENTS}:answers_async", ["\\boxed{42}"], "ep-next")
    assert outcome.error is None and outcome.seq.reward == 1.0  # the same endpoint serves the next episode


def test_an_agent_past_the_episode_timeout_fails_and_its_late_call_is_refused(tokenizer, endpoint):
    outcome, _, _ = episode(tokenizer, endpoint, f"{AGENTS}:hangs", [], "ep-hang", timeout_s=0.5)
    assert outcome.error.startswith("timeout") and endpoint.bridge.open_episodes() == 0
    outcome, _, model = episode(tokenizer, endpoint, f"{AGENTS}:sleeps", ["late"], "ep-sleep", timeout_s=0.5)
    assert outcome.error.startswith("timeout")
    time.sleep(2.0)  # the thread wakes, calls, is refused: no generation, nothing recorded
    assert model.requests == [] and endpoint.recorder.get("ep-sleep") is None


def test_the_builtin_starts_one_endpoint_per_process(tokenizer):
    try:
        outcome, _, _ = episode(tokenizer, None, "areal_mq.workflows.calculator_agent:solve", ["\\boxed{42}"])
        assert outcome.error is None and outcome.seq.reward == 1.0
        assert PROCESS_ENDPOINTS.get(tokenizer) is PROCESS_ENDPOINTS.get(tokenizer)
    finally:
        PROCESS_ENDPOINTS.close()


def test_tool_family_prompted_bare_reads_the_forced_calls_bare_expression(tokenizer):
    """agent.workflow_args.tool_family prompted_bare on the built-in's endpoint: solve_first_call's forced call
    written bare (what SmolLM2 writes) is a call; ctx.info counts the repair; an unknown family is the episode's
    error, named."""
    first = "areal_mq.workflows.calculator_agent:solve_first_call"
    try:
        outcome, ctx, _ = episode(tokenizer, None, first, ["17 + 25}\n", "17 + 25 = 42. \\boxed{42}"],
                                  args={"tool_family": "prompted_bare"})
        assert outcome.error is None and outcome.seq.reward == 1.0
        assert ctx.info["tool_calls"] == 1 and ctx.info["tool_repairs"] == 1 and ctx.info["tool_errors"] == 0
        outcome, ctx, _ = episode(tokenizer, None, first, ["17 + 25}\n", "\\boxed{42}"])  # auto: prompted
        assert ctx.info["tool_calls"] == 0 and ctx.info["tool_errors"] == 1
        outcome, _, _ = episode(tokenizer, None, first, ["\\boxed{42}"], args={"tool_family": "hermes9"})
        assert "tool_family 'hermes9'" in outcome.error
    finally:
        PROCESS_ENDPOINTS.close()


def test_without_openai_a_config_error_names_the_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "openai", None)
    with pytest.raises(ConfigError, match="pip install openai"):
        require_openai()


def test_config_code_imports_neither_openai_nor_the_endpoint():
    code = ("import sys, areal_mq.workflows.builtin, areal_mq.workflows.config; "
            "print(sorted(m for m in ('openai', 'torch', 'areal_mq.openai.server') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_concurrent_episodes_on_an_in_process_engine(tokenizer, endpoint, make_engine):
    """The evaluation's set-up (workflows/local.py): the engine's pump and the endpoint's threads share one loop."""
    from areal_mq.workflows.local import EngineBackend

    backend = EngineBackend(make_engine(max_concurrent=4))

    async def main():
        ctxs = [EpisodeContext(Problem(f"p{i}", f"What is {i} + 2?", str(i + 2)), [1, 2, 3], tokenizer, backend,
                               sampling=SamplingSpec(temperature=0.0, max_new_tokens=16), episode_id=f"eng-{i}",
                               max_tokens=256, args={"agent": "areal_mq.workflows.calculator_agent:solve"})
                for i in range(3)]
        flow = lambda c, p: run_agent(c, p, endpoint)  # noqa: E731
        return ctxs, await asyncio.gather(*(run_episode(flow, c, c.problem, 120) for c in ctxs))

    ctxs, outcomes = asyncio.run(main())
    for ctx, outcome in zip(ctxs, outcomes):
        assert outcome.error is None, outcome.error
        seq = outcome.seq
        assert ctx.info["exact_turns"] == ctx.info["chat_calls"] >= 1
        assert (seq.versions[seq.loss_mask == 1] >= 0).all() and (seq.versions[seq.loss_mask == 0] == -1).all()
        assert 0 < int(seq.loss_mask.sum()) <= 64 * ctx.info["chat_calls"]  # the agent's max_tokens per reply
