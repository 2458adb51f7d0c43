"""Periodic evaluation through the rollout engines (eval.via rollout), the controller's side: the real Controller with
a real RolloutEval (workers/controller_eval.py) on the built-in arith held-out set, against the test kit's InMemoryJobs
and InMemoryStore (areal_mq.testing, passed in):

- at a due published version it submits the held-out problems as requests pinned to it (heldout.py's sampling);
- their answers are graded into run_dir/eval.jsonl with "via": "rollout", never stored as training samples, never
  counted as generated tokens or as groups of the admission ledger;
- an answer with a token of another version, or a version_passed refusal, skips that version (event, no line);
- a resumed run does not evaluate a version already in eval.jsonl; a due version while one runs is skipped, named.
Run: pytest tests/unit/workers/test_controller_eval.py -q
"""
from __future__ import annotations

import json

from areal_mq.config import load_config
from areal_mq.evaluation.heldout import eval_problems
from areal_mq.grading import grade
from areal_mq.messages import Error, GenerateRequest, GenerateResult
from areal_mq.testing import InMemoryJobs, InMemoryStore, RecordingLog
from areal_mq.workers.controller import Controller
from areal_mq.workers.controller_eval import RolloutEval

from .test_admission import Formatter, _Data

SETS = ("eval.every=2", "eval.via=rollout", "eval.size=3", "controller.total_steps=6", "controller.batch_groups=1",
        "controller.group_size=2", "controller.max_concurrent_groups=1", "controller.max_new_tokens=12")


def _controller(tmp_path, *sets):
    cfg = load_config(None, [f"run.run_dir={tmp_path}", *SETS, *sets])
    jobs, store, log = InMemoryJobs(), InMemoryStore(), RecordingLog()
    evaluation = RolloutEval.from_config(cfg, Formatter(), jobs, log)
    return Controller(cfg, _Data(), Formatter(), jobs, store, log, evaluation=evaluation), jobs, store, log


def _eval_jobs(jobs):
    return {j: m for j, m in jobs.pending.items() if isinstance(m, GenerateRequest) and m.pin_version is not None}


def _evals(tmp_path):
    path = tmp_path / "eval.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_a_due_version_is_evaluated_through_pinned_requests_and_never_trained(tmp_path):
    ctl, jobs, store, log = _controller(tmp_path)
    ctl.step(timeout=0.0)
    ctl.on_weights(1)
    assert not _eval_jobs(jobs), "v1 is not due (eval.every 2)"
    ctl.on_weights(2)
    pinned = _eval_jobs(jobs)
    assert len(pinned) == 3
    assert all(m.pin_version == 2 and m.min_version == 2 for m in pinned.values())
    assert all(m.sampling.temperature == 0.0 and m.sampling.max_new_tokens == 12 for m in pinned.values())
    problems = eval_problems(ctl.cfg)
    right = {p.id: f"\\boxed{{{p.answer}}}" for p in problems}
    submitted = {j: problems[i] for i, j in enumerate(pinned)}  # in problem order
    tokens_before, ledger_before = ctl.gen_tokens, ctl.ledger.balance()
    for n, (job_id, p) in enumerate(submitted.items()):
        text = right[p.id] if n < 2 else "no idea"
        jobs.answer(job_id, GenerateResult(output_ids=[5, 6, 7], logprobs=[-0.1] * 3, versions=[2] * 3,
                                           finish_reason="stop", text=text))
    ctl.step(timeout=0.0)
    (line,) = _evals(tmp_path)
    assert line["via"] == "rollout" and line["version"] == 2 and line["n"] == 3
    assert line["strict"] == sum(grade(right[p.id] if i < 2 else "no idea", p.answer).strict
                                 for i, p in enumerate(problems)) / 3 == 2 / 3
    assert {"lenient", "by_level", "seconds", "samples", "temperature"} <= set(line)
    answers = [json.loads(x) for x in (tmp_path / "eval_answers" / "v2.jsonl").read_text().splitlines()]
    assert sorted(a["id"] for a in answers) == sorted(p.id for p in problems)
    assert store.samples == [] and ctl.stored == 0, "evaluation answers never reach the sample store"
    assert ctl.gen_tokens == tokens_before and ctl.ledger.balance() == ledger_before
    done = log.named("controller.eval_done")
    assert len(done) == 1 and done[0]["version"] == 2 and done[0]["strict"] == round(line["strict"], 4)
    ctl.on_weights(3)
    assert not _eval_jobs(jobs)


def test_an_answer_of_another_version_skips_the_evaluation(tmp_path):
    ctl, jobs, store, log = _controller(tmp_path)
    ctl.on_weights(2)
    for i, job_id in enumerate(_eval_jobs(jobs)):
        jobs.answer(job_id, GenerateResult(output_ids=[5, 6], logprobs=[-0.1, -0.1], versions=[2, 3 if i == 1 else 2],
                                           finish_reason="stop", text="x"))
    ctl.step(timeout=0.0)
    assert _evals(tmp_path) == []
    (skipped,) = log.named("controller.eval_skipped")
    assert skipped["version"] == 2 and "versions [3]" in skipped["reason"]


def test_a_version_passed_refusal_skips_the_evaluation(tmp_path):
    ctl, jobs, store, log = _controller(tmp_path)
    ctl.on_weights(2)
    first = next(iter(_eval_jobs(jobs)))
    jobs.answer(first, Error(code="version_passed", message="pinned to 2, the worker holds 3", ref_id=first))
    ctl.step(timeout=0.0)
    assert _evals(tmp_path) == [] and "version_passed" in log.named("controller.eval_skipped")[0]["reason"]
    assert ctl.failed == 0 and not log.named("controller.retry"), "an evaluation request is no group to retry"


def test_a_resumed_run_skips_versions_in_eval_jsonl_and_one_evaluation_runs_at_a_time(tmp_path):
    (tmp_path / "eval.jsonl").write_text(json.dumps({"version": 2, "strict": 0.5}) + "\n")
    ctl, jobs, store, log = _controller(tmp_path, "eval.every=1")
    ctl.on_weights(2)
    assert not _eval_jobs(jobs)
    ctl.on_weights(3)
    assert {m.pin_version for m in _eval_jobs(jobs).values()} == {3}
    ctl.on_weights(4)
    assert {m.pin_version for m in _eval_jobs(jobs).values()} == {3}
    assert "v3 was still running" in log.named("controller.eval_skipped")[0]["reason"]
    ctl.on_weights(6)
    assert {m.pin_version for m in _eval_jobs(jobs).values()} == {3}, "the final version is evaluated after training"


def test_via_process_builds_no_rollout_evaluation(tmp_path):
    cfg = load_config(None, [f"run.run_dir={tmp_path}", "eval.every=2"])
    assert cfg.eval.via == "process"
    assert RolloutEval.from_config(cfg, Formatter(), InMemoryJobs(), RecordingLog()) is None
