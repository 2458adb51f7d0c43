"""Periodic held-out evaluation through the rollout engines (eval.via rollout): the controller's side.

What: when the trainer publishes a version N that is due (evaluation/periodic.py `due_versions`: N % eval.every == 0,
0 < N < total_steps, not in run_dir/eval.jsonl yet) and no evaluation is in flight, the controller sends the held-out
problems as GenerateRequests pinned to N (min_version = pin_version = N). Problems, sampling (greedy by default,
eval.temperature / eval.samples) and request ids are heldout.py's (`eval_problems`, `eval_params`, `request_ids`), the
prompt is the controller's chat formatter, built as `areal-mq eval` builds it; so the answers equal a standalone
evaluation of N's weights (greedy; tests/integration/test_e2e.py checks it per problem, torch engine on the CPU; GPU
kernels whose sums depend on the batch can flip near-tied tokens, in a standalone evaluation of another width too).
The answers never join a group, the sample store or the generated-token count. When all are back they are graded with heldout's `score`, one
line goes to run_dir/eval.jsonl (the standalone evaluation's fields plus "via": "rollout", so `areal-mq plot`, the
live display and the benchmarks read it unchanged), the answers to run_dir/eval_answers/vN.jsonl, and
controller.eval_done is logged.
Never a wrong number: an answer with a token of another version (a worker's pin bound expired), or any Error
(version_passed: a worker was past N before the request reached it; or another failure), skips that version:
controller.eval_skipped names the reason and nothing is written to eval.jsonl. An evaluation still running when the
run ends is skipped the same way.

    evaluation = RolloutEval.from_config(cfg, formatter, jobs, log)  # None unless eval.via rollout
    ctl = Controller(cfg, dataset, formatter, jobs, store, log, evaluation=evaluation)
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from areal_mq.evaluation.heldout import append_result, eval_params, eval_problems, request_ids, score
from areal_mq.evaluation.periodic import due_versions
from areal_mq.messages import Error, GenerateRequest, GenerateResult


@dataclass
class Answer:
    """One answer as heldout's `score` reads it (an engine output's request_id, text, finish_reason)."""

    request_id: str
    text: str
    finish_reason: str


@dataclass
class _Running:
    version: int
    jobs: dict[str, str]  # job id -> request id (heldout.request_ids)
    started: float = field(default_factory=time.monotonic)
    answers: list[Answer] = field(default_factory=list)


class RolloutEval:
    """One evaluation at a time, pinned to a published version; `from_config` is None unless eval.via is rollout."""

    def __init__(self, cfg: Any, problems: list, formatter: Any, jobs: Any, log: Any, done: set[int]):
        self.run_dir, self.every, self.last_step = Path(cfg.run.run_dir), cfg.eval.every, cfg.controller.total_steps
        self.problems, self.formatter, self.jobs, self.log, self.done = problems, formatter, jobs, log, done
        self.samples, self.sampling, self.ks = eval_params(cfg)
        self.running: _Running | None = None

    @classmethod
    def from_config(cls, cfg: Any, formatter: Any, jobs: Any, log: Any) -> "RolloutEval | None":
        """Versions already in run_dir/eval.jsonl (a resumed run) are not evaluated again."""
        if not cfg.eval.every or cfg.eval.via != "rollout":
            return None
        from areal_mq.telemetry.plots import read_jsonl

        done = {int(e["version"]) for e in read_jsonl(Path(cfg.run.run_dir) / "eval.jsonl")
                if isinstance(e.get("version"), int)}
        return cls(cfg, eval_problems(cfg), formatter, jobs, log, done)

    def on_version(self, version: int) -> None:
        """A newly published version: evaluate it if it is due and nothing else is being evaluated."""
        if not due_versions([version], self.every, self.last_step, self.done):
            return
        self.done.add(version)
        if self.running is not None:
            self.log.warning("controller.eval_skipped", version=version, via="rollout",
                             reason=f"the evaluation of v{self.running.version} was still running")
            return
        jobs = {}
        for p in self.problems:
            ids = self.formatter.ids(p)
            for rid in request_ids(p, self.samples):
                job = self.jobs.submit(GenerateRequest(prompt_ids=ids, sampling=self.sampling,
                                                       group_id=f"eval-v{version}", min_version=version,
                                                       pin_version=version), service="generate")
                jobs[job] = rid
        self.running = _Running(version, jobs)
        self.log.info("controller.eval_started", version=version, via="rollout", requests=len(jobs))

    def owns(self, job_id: str) -> bool:
        return self.running is not None and job_id in self.running.jobs

    def on_answer(self, job_id: str, msg: Any) -> None:
        """One answer of the running evaluation (owns(job_id) was true)."""
        run = self.running
        rid = run.jobs.pop(job_id)
        if isinstance(msg, Error):
            self._skip(f"{rid}: [{msg.code}] {msg.message[:300]}")
            return
        if not isinstance(msg, GenerateResult):
            self._skip(f"{rid}: a {msg.kind.value} is no answer to a generate_request")
            return
        other = sorted({int(v) for v in np.unique(msg.versions)} - {run.version})
        if other:
            self._skip(f"{rid}: tokens of versions {other[:5]} in an answer pinned to v{run.version}")
            return
        run.answers.append(Answer(rid, msg.text, msg.finish_reason))
        if not run.jobs:
            self._finish(run)

    def stop(self) -> None:
        """The run ends: an evaluation still waiting for answers is skipped."""
        if self.running is not None:
            self._skip(f"the run ended with {len(self.running.jobs)} answers still out")

    def _skip(self, reason: str) -> None:
        run, self.running = self.running, None
        self.log.warning("controller.eval_skipped", version=run.version, via="rollout", reason=reason,
                         answered=len(run.answers))

    def _finish(self, run: _Running) -> None:
        self.running = None
        seconds = round(time.monotonic() - run.started, 1)
        result = {**score(run.answers, self.problems, self.samples, self.ks), "weights": f"rollout:v{run.version}",
                  "version": run.version, "samples": self.samples, "temperature": self.sampling.temperature,
                  "seconds": seconds, "via": "rollout"}
        append_result(self.run_dir, result)
        answers = self.run_dir / "eval_answers" / f"v{run.version}.jsonl"
        answers.parent.mkdir(parents=True, exist_ok=True)
        answers.write_text("".join(json.dumps({"id": a.request_id, "text": a.text, "finish_reason": a.finish_reason})
                                   + "\n" for a in sorted(run.answers, key=lambda a: a.request_id)))
        self.log.info("controller.eval_done", version=run.version, via="rollout", n=result["n"],
                      strict=round(result["strict"], 4), lenient=round(result["lenient"], 4), seconds=seconds)

