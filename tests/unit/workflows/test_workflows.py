"""Workflows on the tiny model's real engine (in-process backend): per-token versions across a weight update,
the built-ins end to end and graded by the configured reward task (ctx.score), the safe calculator, bad workflows
failing their episode only, bad specs refused."""
from __future__ import annotations

import asyncio

import numpy as np
import pytest

from areal_mq.data.loaders import Problem
from areal_mq.errors import ConfigError, RewardError
from areal_mq.messages import RewardResult, SamplingSpec
from areal_mq.rewards.arith_reward import arith_reward
from areal_mq.rewards.config import RewardConfig, TaskConfig
from areal_mq.testing import ScriptedModel
from areal_mq.workflows.builtin import BUILTINS, pending_call
from areal_mq.workflows.calc import CalcError, calc
from areal_mq.workflows.context import EpisodeContext, RewardVerdict, WorkflowError
from areal_mq.workflows.local import EngineBackend, LocalRewards
from areal_mq.workflows.runner import load_workflow, run_episode

pytestmark = pytest.mark.timeout(300)
PROBLEM = Problem("p1", "What is 2 + 3?", "5")


def context(engine, tokenizer, **kw) -> EpisodeContext:
    text = tokenizer.apply_chat_template([{"role": "user", "content": PROBLEM.prompt}], tokenize=False,
                                         add_generation_prompt=True)
    ids = tokenizer.encode(text, add_special_tokens=False)
    sampling = kw.pop("sampling", SamplingSpec(temperature=0.0, max_new_tokens=8, ignore_eos=True))
    return EpisodeContext(PROBLEM, list(ids), tokenizer, EngineBackend(engine, kw.pop("on_step", None)),
                          sampling=sampling, episode_id="ep-1", **kw)


def test_a_turn_spanning_a_weight_update_is_stamped_per_token(make_engine, tiny_tokenizer, hf_tiny):
    from tests.unit.engines.engine_refs import perturbed_state

    engine = make_engine(kv_on_update="recompute")
    steps = []

    def update_after_three(eng):  # a trainer publishing v1 while turn 1 is being decoded
        steps.append(1)
        if len(steps) == 3:
            eng.update_weights(1, tensors=perturbed_state(hf_tiny, seed=7))

    async def episode(ctx, problem):
        await ctx.generate(ctx.prompt_ids)
        ctx.add_user_turn("Your answer is wrong. Try again.")
        await ctx.generate()
        return 0.0

    ctx = context(engine, tiny_tokenizer, on_step=update_after_three)
    outcome = asyncio.run(run_episode(episode, ctx, PROBLEM, 120))
    assert outcome.error is None, outcome.error
    seq = outcome.seq
    gen = seq.versions[seq.loss_mask == 1].tolist()
    assert gen[:8] == [0, 0, 0, 1, 1, 1, 1, 1]  # turn 1: 3 tokens under v0, the rest under v1
    assert gen[8:] == [1] * 8                   # turn 2: all v1
    assert (seq.versions[seq.loss_mask == 0] == -1).all() and (seq.loss_mask == 0).sum() > 0
    feedback = tiny_tokenizer.decode(seq.output_ids[seq.loss_mask == 0])
    assert "Your answer is wrong. Try again." in feedback and "<|im_start|>user" in feedback
    # the second turn's prompt was the whole episode: first prompt + turn 1 + feedback, token for token
    assert outcome.turns == 2 and len(seq.output_ids) == 16 + (seq.loss_mask == 0).sum()


@pytest.mark.parametrize("name", sorted(BUILTINS))
def test_builtins_run_end_to_end_on_the_tiny_model(make_engine, tiny_tokenizer, name):
    args = {"attempts": 3, "agent": "areal_mq.workflows.calculator_agent:solve"}  # what each built-in reads
    ctx = context(make_engine(), tiny_tokenizer, args=args,
                  sampling=SamplingSpec(temperature=1.0, max_new_tokens=12, seed=3))
    outcome = asyncio.run(run_episode(BUILTINS[name], ctx, PROBLEM, 120))
    assert outcome.error is None, outcome.error
    seq = outcome.seq
    assert np.isfinite(seq.reward) and outcome.turns >= 1
    assert seq.loss_mask.sum() > 0 and (seq.versions[seq.loss_mask == 1] >= 0).all()
    if name == "multi_turn_retry" and ctx.info["correct_at"] == 0:  # a random tiny model: wrong every time
        assert outcome.turns == 3 and seq.reward <= 0.0


def scripted_ctx(tokenizer, texts, rewards=None, **kw) -> EpisodeContext:
    model = ScriptedModel(tokenizer, texts, rewards=rewards or LocalRewards())  # the real arith task, in process
    return EpisodeContext(PROBLEM, [1, 2, 3], tokenizer, model, sampling=SamplingSpec(max_new_tokens=16),
                          episode_id="ep-9", **kw)


def test_multi_turn_retry_discounts_a_second_try_success(tiny_tokenizer):
    ctx = scripted_ctx(tiny_tokenizer, ["It is \\boxed{6}.", "Sorry: 2 + 3 = \\boxed{5}."])
    outcome = asyncio.run(run_episode(BUILTINS["multi_turn_retry"], ctx, PROBLEM, 10))
    assert outcome.seq.reward == 0.5 and ctx.info == {"attempts": 2, "correct_at": 2}
    assert all(r.session == "ep-9" for r in ctx.backend.requests)  # every turn carries the episode's session


def test_tool_calc_evaluates_the_call_and_appends_the_result(tiny_tokenizer):
    ctx = scripted_ctx(tiny_tokenizer, ["<calc>2 + 3</calc>", " so \\boxed{5}."])
    outcome = asyncio.run(run_episode(BUILTINS["tool_calc"], ctx, PROBLEM, 10))
    assert outcome.seq.reward == 1.0 and ctx.info["tool_calls"] == 1
    env = tiny_tokenizer.decode(outcome.seq.output_ids[outcome.seq.loss_mask == 0])
    assert env == "<result>5</result>"  # the model closed the tag itself: only the result is appended
    assert ctx.backend.requests[0].sampling.stop_strings == ["</calc>"]


@pytest.mark.parametrize("name, texts", [("single", ["It is \\boxed{5}."]),
                                         ("multi_turn_retry", ["\\boxed{6} \\boxed{6}", "\\boxed{5}"]),
                                         ("tool_calc", ["<calc>2 + 3</calc>", " so \\boxed{5}."])])
def test_builtins_grade_with_the_configured_reward_task(tiny_tokenizer, name, texts):
    """issue 28 item 6: controller.reward_task applies to the built-ins. They ask ctx.score, which sends one
    RewardJob per graded turn with the context's task, the problem and the truncation flag; the task's verdict
    (here a scripted one: reward 0.25, not correct) decides the reward, the retry and ctx.info."""
    seen = []

    def task_mine(job):
        seen.append(job)
        return {"reward": 0.25, "correct": False, "reason": "mine"}

    ctx = scripted_ctx(tiny_tokenizer, texts, rewards=task_mine, reward_task="mine")
    outcome = asyncio.run(run_episode(BUILTINS[name], ctx, PROBLEM, 10))
    assert outcome.error is None, outcome.error
    assert seen and all(j.task == "mine" and j.prompt_id == "p1" and j.reference == "5" and j.truncated == [False]
                        for j in seen)
    assert ctx.info["correct_at"] == 0
    # a positive but incorrect verdict: single/tool_calc pay it, multi_turn_retry retries and then pays only a penalty
    assert outcome.seq.reward == (0.0 if name == "multi_turn_retry" else 0.25)
    assert len(seen) == (2 if name == "multi_turn_retry" else 1)


def test_a_configured_task_scores_the_builtins_in_process(tiny_tokenizer):
    """LocalRewards scores under a RewardConfig's tasks like a reward worker: the `format` task pays a boxed
    answer whatever its number, so multi_turn_retry's first (wrong) answer counts as reward 1, not correct."""
    rewards = LocalRewards(RewardConfig(tasks={"fmt": TaskConfig(fn="format")}))
    ctx = scripted_ctx(tiny_tokenizer, ["It is \\boxed{6}."], rewards=rewards, reward_task="fmt")
    outcome = asyncio.run(run_episode(BUILTINS["single"], ctx, PROBLEM, 10))
    assert outcome.seq.reward == 1.0 and ctx.info == {"attempts": 1, "correct_at": 1}  # no `correct`: reward > 0
    with pytest.raises(RewardError, match="unknown reward task .nope."):
        rewards.score(ctx.backend.reward_jobs[0].model_copy(update={"task": "nope"}))


@pytest.mark.parametrize("text, truncated", [("It is \\boxed{5}.", False), ("\\boxed{4}", False),
                                             ("\\boxed{5} \\boxed{5}", False), ("5", False),
                                             ("\\boxed{5}", True)])
def test_the_default_task_gives_exactly_the_arith_reward(tiny_tokenizer, text, truncated):
    """Default behaviour unchanged: controller.reward_task defaults to arith, and ctx.score's numbers are
    arith_reward's (the function the built-ins called directly before)."""
    ctx = scripted_ctx(tiny_tokenizer, [])
    verdict = asyncio.run(ctx.score(text, truncated=truncated))
    direct = arith_reward(PROBLEM.prompt, text, PROBLEM.answer, truncated=truncated)
    assert (verdict.reward, verdict.correct, verdict.reason) == (direct["reward"], direct["correct"], direct["reason"])
    assert asyncio.run(ctx.reward(text, truncated=truncated)) == direct["reward"]  # the float API stays
    assert ctx.backend.reward_jobs[0].task == "arith"


def test_a_failed_scoring_is_the_default_reward_with_its_error(tiny_tokenizer):
    verdict = RewardVerdict.of(RewardResult(rewards=[-1.0], details=[{"default_reward": True}],
                                            errors=["timeout: 10 s"]))
    assert (verdict.reward, verdict.correct, verdict.reason, verdict.error) == (-1.0, False, "error", "timeout: 10 s")
    bad = Problem("p2", "What is x?", "not a number")  # arith needs an integer reference: its function raises
    ctx = EpisodeContext(bad, [1], tiny_tokenizer, ScriptedModel(tiny_tokenizer, [], rewards=LocalRewards()),
                         sampling=SamplingSpec(), episode_id="ep-2")
    verdict = asyncio.run(ctx.score("\\boxed{3}"))
    assert verdict.reward == 0.0 and not verdict.correct and "integer reference" in verdict.error


def test_scripted_rewards_may_be_a_result_or_awaitable(tiny_tokenizer):
    async def later(job):
        return RewardResult(rewards=[0.75], details=[{"correct": True}])

    ctx = scripted_ctx(tiny_tokenizer, [], rewards=later)
    assert asyncio.run(ctx.score("x")) == RewardVerdict(0.75, True, "", {"correct": True}, None)


@pytest.mark.parametrize("expr, value", [("3*(4+5)", "27"), ("7/2", "3.5"), ("2**10 // 3", "341"), ("-5 % 3", "1"),
                                         ("1,000 + 1", "1001"), ("6 × 7", "42")])
def test_calc_computes_arithmetic(expr, value):
    assert calc(expr) == value


@pytest.mark.parametrize("expr", ["__import__('os').system('id')", "open('/etc/passwd')", "9**9**9", "1/0",
                                  "2**0.5", "x + 1", "(1)" * 200, "[1] * 10**9", "1e999", "lambda: 1", "",
                                  "-" * 100 + "1", "+".join(["1"] * 40)])
def test_calc_refuses_anything_but_bounded_arithmetic(expr):
    with pytest.raises(CalcError):
        calc(expr)


def test_pending_call_finds_an_open_unanswered_call():
    assert pending_call("I compute <calc>3 * 4") == "3 * 4"
    assert pending_call("<calc>1+1</calc><result>2</result> done") is None
    assert pending_call("no tool \\boxed{3}") is None


async def _raises(ctx, problem):
    await ctx.generate(ctx.prompt_ids)
    raise RuntimeError("workflow bug")


async def _hangs(ctx, problem):
    await asyncio.sleep(3600)


async def _nan(ctx, problem):
    await ctx.generate(ctx.prompt_ids)
    return float("nan")


async def _rewrites_history(ctx, problem):
    await ctx.generate(ctx.prompt_ids)
    await ctx.generate([9, 9, 9])  # does not extend the episode: refused
    return 1.0


@pytest.mark.parametrize("fn, why", [(_raises, "RuntimeError: workflow bug"), (_hangs, "timeout"),
                                     (_nan, "not a finite reward"), (_rewrites_history, "must extend")])
def test_a_bad_workflow_fails_its_episode_with_a_reason(tiny_tokenizer, fn, why):
    ctx = scripted_ctx(tiny_tokenizer, ["a", "b"])
    outcome = asyncio.run(run_episode(fn, ctx, PROBLEM, 0.5))
    assert outcome.seq is None and why in outcome.error


def test_too_many_turns_is_a_workflow_error(tiny_tokenizer):
    ctx = scripted_ctx(tiny_tokenizer, ["a", "b"], max_turns=1)

    async def two(ctx, problem):
        await ctx.generate(ctx.prompt_ids)
        await ctx.generate()

    outcome = asyncio.run(run_episode(two, ctx, PROBLEM, 5))
    assert WorkflowError.__name__ in outcome.error and "max_turns" in outcome.error


@pytest.mark.parametrize("spec, why", [("nocolon", "built-in"), ("no_such_module_xyz:f", "cannot import"),
                                       ("areal_mq.workflows.calc:nothing", "has no"),
                                       ("areal_mq.workflows.calc:calc", "async function"), ("os:system; x", "built-in")])
def test_bad_workflow_specs_are_config_errors(spec, why):
    with pytest.raises(ConfigError, match=why):
        load_workflow(spec)


def test_builtin_names_and_import_paths_load():
    assert load_workflow("multi_turn_retry") is BUILTINS["multi_turn_retry"]
    assert load_workflow("areal_mq.workflows.builtin:tool_calc") is BUILTINS["tool_calc"]
