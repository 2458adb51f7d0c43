"""`areal-mq worker controller`: dataset -> groups of GenerateRequests (or EpisodeJobs) -> rewards -> sample store.

Dataflow (async mode):

    dataset ──prompt──► admit? ──n × GenerateRequest──► job broker ──► rollout workers
                          ▲                                              │ GenerateResult
       WeightsReady(v) ───┘ (signal bus)                                 ▼
                                     group complete ──RewardJob──► reward workers
                                                     ◄─RewardResult──┘
                                     Sample(group, rewards, per-token versions, logprobs) ──► sample store
    (agent.workflow set: n × EpisodeJob ──► agent workers ──► n × EpisodeResult ──► the same Sample path)

Invariants:
- admission (`can_admit`, controller_admission.py: the one definition of the η rule): a new prompt only while
  `submitted_groups < (max_staleness + v + 1) * batch_groups` and fewer than `max_concurrent_groups` groups
  are in flight (v = newest policy version seen);
- every request carries `min_version = v`, so no worker starts it on older weights than the controller knew;
- a failed or refused generation/episode/reward job is retried (up to `max_retries`, with a pause), never silently
  lost: a group that still fails is logged as `controller.group_failed` with the reason;
- a group reaches the store exactly once (sample_id = group id; the store deduplicates resends);
- with `drop_uniform_groups`, a uniform group (rewards all equal, or with `uniform_by: outcome` every answer
  right or every answer wrong: areal_mq/rewards/shaping.py) is logged as `controller.group_dropped` and not
  stored; it stops counting as submitted, so admission replaces it (DAPO's dynamic sampling: the trainer's steps
  are spent on groups that teach something); stats() reports sampled_per_trained;
- with `overlong_buffer` > 0, DAPO's soft overlong punishment is added to each answer's reward (its own reward
  stays in the seq's info as reward_raw); reward jobs carry every answer's token count and the cap;
- every admitted group leaves the admission ledger (controller_admission.py, beside the η rule) exactly once:
  stored, dropped_uniform, failed, or (after it was stored) stale when the sample store drops it — the store's
  stats name the groups it dropped, polled every few seconds — so losses never eat the staleness bound;
- one store path (`_store`) for both kinds of group: single answers scored by a RewardJob, and episodes
  (agent.workflow set: controller_episodes.EpisodePath submits EpisodeJobs, the workflow's reward is the
  episode's) — the same reward stats, policy versions, uniform-group drop and put;
- nothing non-finite reaches the store: a generation with NaN/inf logprobs or a reward result with NaN/inf
  rewards fails its group at once (`controller.group_failed` names the positions); a reward result whose
  every completion failed to score counts as a failed reward job (retried, then the group fails); one whose
  reward count is not the group size fails its group at once (a reward worker out of protocol);
- the policy version never goes back on a bus replay of "base" (a restarted bus); a real older version
  (a trainer resumed from a checkpoint) is followed;
- `batch_order: admission` puts finished groups in the order they were admitted: a finished group is held
  (still in flight for the ledger, regenerated on resume) until every group admitted before it was stored,
  dropped or failed, so the trainer's batches are the earliest admitted groups, not the fastest generated;
- the strict per-sample staleness filter lives in the sample store (it knows the trainer's version);
- eval.via rollout (controller_eval.py): a published version due for evaluation sends the held-out problems as
  GenerateRequests pinned to it; their answers are graded into run_dir/eval.jsonl and never join a group, the
  store, the admission ledger or the generated-token count.
Who waits on whom: the controller waits on nobody's speed — it only stops admitting when the bound says so.
Sync mode (`run.mode: sync`) is the classic loop: one whole batch is admitted, generated, rewarded and stored,
and the next is admitted only when the trainer has published the next version. That is exactly the
admission rule with η = 0, so sync mode forces η = 0 and reuses it; what differs between the modes is the
launcher's thread split (sync phases alternate, so each may use every core).
"""
from __future__ import annotations

import collections
import hashlib
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from areal_mq.actor.roles import Role, RoleLoop
from areal_mq.balance import SplitAdvisor
from areal_mq.errors import JobFailed
from areal_mq.messages import (EpisodeResult, Error, GenerateRequest, GenerateResult, RewardJob, RewardResult, Sample,
                               SamplingSpec, SeqSample, WeightsReady, length_bucket)
from areal_mq.rewards.shaping import overlong_penalty, uniform_group
from areal_mq.workers.controller_admission import AdmissionLedger, can_admit
from areal_mq.workers.controller_episodes import EpisodePath


STORE_FULL_RETRY_S = 2.0  # pause before a put the store refused as full is tried again


def nonfinite_reason(values: Any, what: str) -> str | None:
    """Why `values` must not reach the store (NaN or inf among them), or None when all are finite."""
    arr = np.asarray(values, dtype=np.float64)
    bad = np.flatnonzero(~np.isfinite(arr))
    if bad.size == 0:
        return None
    return f"non-finite {what} at positions {bad[:5].tolist()} (e.g. {arr[bad[0]]}) of {arr.size}"


def scored_answers(prompt_ids: list[int], answers: list[GenerateResult], scored: RewardResult,
                   overlong: tuple[int, int, float] = (0, 0, 0.0), overlong_filter: bool = False) -> list[SeqSample]:
    """A single-turn group's answers, in sample order, with the reward job's rewards (and details) -> seqs.
    overlong (max_tokens, buffer, factor): DAPO's soft overlong punishment added to each reward (rewards/shaping.py;
    the reward worker's own reward stays in info["reward_raw"]). overlong_filter: DAPO's overlong filtering, a
    truncated answer (finish_reason "length") is marked loss_excluded (its reward still counts in the group)."""
    details = scored.details or [{}] * len(answers)
    seqs = []
    for r, rw, d in zip(answers, scored.rewards, details):
        info: dict = {"detail": d} if d else {}
        penalty = overlong_penalty(len(r.output_ids), *overlong)
        if penalty:
            info.update(reward_raw=float(rw), overlong_penalty=penalty)
        seqs.append(SeqSample(prompt_ids=prompt_ids, output_ids=r.output_ids, logprobs=r.logprobs, versions=r.versions,
                              reward=float(rw) + penalty, finish_reason=r.finish_reason, info=info,
                              loss_excluded=overlong_filter and r.finish_reason == "length"))
    return seqs


def request_seed(run_seed: int, group_id: str, index: int) -> int:
    digest = hashlib.sha256(f"{run_seed}/{group_id}/{index}".encode()).digest()
    return int.from_bytes(digest[:4], "little") & 0x7FFFFFFF


@dataclass
class Group:
    group_id: str
    problem: Any
    prompt_ids: list[int]
    results: dict[int, GenerateResult | EpisodeResult] = field(default_factory=dict)  # sample index -> answer
    reward_job: str | None = None
    retries: int = 0
    submitted_at: float = field(default_factory=time.monotonic)
    unstored: tuple | None = None  # (sample, reward_mean, versions) the store refused while full


class Controller(Role):
    """A Role without a broker service: its work is admission and answers (JobClient), ticked by the loop.
    Paused (Control pause): admits nothing new; answers, retries and stores go on."""

    name = "controller"
    stats_every_s = 2.0

    def __init__(self, cfg: Any, dataset: Any, formatter: Any, jobs: Any, store: Any, log: Any, rt: Any = None,
                 evaluation: Any = None):
        super().__init__(rt)
        self.cfg, self.ctl_cfg = cfg, cfg.controller
        self.dataset, self.formatter, self.jobs, self.store, self.log = dataset, formatter, jobs, store, log
        self.version = 0
        self.ledger = AdmissionLedger()
        self._next_store_poll = 0.0
        self.next_group = 0  # group ids are never reused, even when a dropped group frees its place
        self.dropped = 0
        self.dropped_by_length: dict[str, int] = {}
        self.groups: dict[str, Group] = {}
        self.admission_order: collections.deque[str] = collections.deque()  # batch_order admission: ids to put
        self.held: dict[str, tuple] = {}  # batch_order admission: finished (sample, reward_mean, versions)
        self.by_job: dict[str, tuple[str, str, int]] = {}  # job id -> (kind, group id, sample index)
        self.retry_at: list[tuple[float, str, str, int]] = []
        self.stored = 0
        self.failed = 0
        self.gen_tokens = 0
        self.rewards: list[float] = []
        self.started = time.monotonic()
        self.state_path = Path(cfg.run.run_dir) / "controller_state.json"
        self.advisor, self.store_depth = SplitAdvisor.from_config(cfg), 0  # generation:training split (balance.py)
        self.episodes = EpisodePath(jobs) if cfg.agent.workflow else None  # multi-turn: a workflow per sample
        self.evaluation = evaluation  # controller_eval.RolloutEval (eval.via rollout), else None

    # ------------------------------------------------------------ admission
    def admit(self) -> int:
        admitted = 0
        while can_admit(self.submitted, self.version, self.cfg.staleness_bound, self.ctl_cfg.batch_groups,
                        len(self.groups),
                        self.ctl_cfg.max_concurrent_groups):
            try:
                problem = next(self.dataset)
            except StopIteration:
                break
            self._start_group(problem)
            admitted += 1
        return admitted

    def _start_group(self, problem: Any) -> None:
        group_id = f"g{self.next_group:07d}-{problem.id}"
        self.next_group += 1
        self.ledger.admit(group_id)
        group = Group(group_id, problem, self.formatter.ids(problem))
        self.groups[group_id] = group
        if self.ctl_cfg.batch_order == "admission":
            self.admission_order.append(group_id)
        self.log.info("controller.group_admitted", group=group_id, problem=problem.id, version=self.version)
        for i in range(self.ctl_cfg.group_size):
            self._submit_sample(group, i)

    def _sampling(self, group: Group, index: int) -> SamplingSpec:
        """The sampling of sample `index` of `group` (a single answer, or every turn of an episode)."""
        return SamplingSpec(temperature=self.ctl_cfg.temperature, top_p=self.ctl_cfg.top_p,
                            max_new_tokens=self.ctl_cfg.max_new_tokens,
                            seed=request_seed(self.cfg.run.seed, group.group_id, index))

    def _submit_sample(self, group: Group, index: int) -> None:
        """Sample `index` of `group`: a GenerateRequest, or an EpisodeJob when a workflow runs each sample."""
        sampling = self._sampling(group, index)
        if self.episodes is not None:
            job, kind = self.episodes.submit(group, index, sampling, self.version), "episode"
        else:
            job, kind = self.jobs.submit(GenerateRequest(prompt_ids=group.prompt_ids, sampling=sampling,
                                                         group_id=group.group_id, sample_index=index,
                                                         min_version=self.version), service="generate"), "generate"
        self.by_job[job] = (kind, group.group_id, index)

    # ------------------------------------------------------------ answers
    def on_answer(self, job_id: str, msg: Any) -> None:
        if self.evaluation is not None and self.evaluation.owns(job_id):  # a pinned evaluation answer: no group's
            self.evaluation.on_answer(job_id, msg)
            return
        kind, group_id, index = self.by_job.pop(job_id, (None, "", 0))
        group = self.groups.get(group_id)
        if group is None:
            return
        if isinstance(msg, Error):
            self._retry(group, kind, index, f"[{msg.code}] {msg.message}")
        elif kind == "episode" and isinstance(msg, EpisodeResult):
            if self._collect(group, index, msg, EpisodePath.generated_tokens(msg)):
                self._store(group, *EpisodePath.scored(self._ordered(group)))  # the workflow's reward: no RewardJob
        elif kind == "generate" and isinstance(msg, GenerateResult):
            if (why := nonfinite_reason(msg.logprobs, "logprobs")) is not None:
                self._fail(group, kind, f"sample {index}: {why}")
            elif self._collect(group, index, msg, len(msg.output_ids)):
                self._submit_reward(group)
        elif kind == "reward" and isinstance(msg, RewardResult):
            if len(msg.rewards) != self.ctl_cfg.group_size:  # a reward worker out of protocol: no retry helps
                self._fail(group, kind, f"{len(msg.rewards)} rewards for {self.ctl_cfg.group_size} completions")
            elif msg.errors and all(msg.errors):  # every completion's scoring failed: the reward job failed
                self._retry(group, kind, index, f"no completion could be scored: {msg.errors[0]}")
            elif (why := nonfinite_reason(msg.rewards, "rewards")) is not None:
                self._fail(group, kind, why)
            else:
                c = self.ctl_cfg
                overlong = (c.max_new_tokens, c.overlong_buffer, c.overlong_penalty)
                self._store(group, scored_answers(group.prompt_ids, self._ordered(group), msg, overlong,
                                                  c.overlong_filter), {})

    def _collect(self, group: Group, index: int, answer: GenerateResult | EpisodeResult, tokens: int) -> bool:
        """Keep sample `index`'s answer (`tokens` generated); True once every sample of the group is back."""
        group.results[index] = answer
        self.gen_tokens += tokens
        return len(group.results) == self.ctl_cfg.group_size

    def _ordered(self, group: Group) -> list:
        return [group.results[i] for i in range(self.ctl_cfg.group_size)]

    def _retry(self, group: Group, kind: str, index: int, reason: str) -> None:
        group.retries += 1
        if group.retries > self.ctl_cfg.max_retries:
            self._fail(group, kind, reason)
            return
        self.log.warning("controller.retry", group=group.group_id, stage=kind, reason=reason, attempt=group.retries)
        self.retry_at.append((time.monotonic() + min(5.0, 0.5 * 2 ** group.retries), kind, group.group_id, index))

    def _fail(self, group: Group, kind: str, reason: str) -> None:
        """The group leaves for good (ledger: failed); admission may replace it."""
        self.groups.pop(group.group_id, None)
        self.ledger.settle(group.group_id, "failed")
        self.failed += 1
        self.log.error("controller.group_failed", group=group.group_id, stage=kind, reason=reason,
                       retries=max(0, group.retries - 1))

    def _run_retries(self) -> None:
        now = time.monotonic()
        due = [r for r in self.retry_at if r[0] <= now]
        self.retry_at = [r for r in self.retry_at if r[0] > now]
        for _, kind, group_id, index in due:
            group = self.groups.get(group_id)
            if group is None:
                continue
            if kind in ("generate", "episode"):
                self._submit_sample(group, index)
            elif kind == "store":
                self._put(group, *group.unstored)
            else:
                self._submit_reward(group)

    def _submit_reward(self, group: Group) -> None:
        ordered = self._ordered(group)
        job = self.jobs.submit(RewardJob(
            task=self.ctl_cfg.reward_task, prompt_id=group.problem.id, prompt=group.problem.prompt,
            completions=[r.text for r in ordered], reference=group.problem.answer,
            truncated=[r.finish_reason == "length" for r in ordered], lengths=[len(r.output_ids) for r in ordered],
            max_tokens=self.ctl_cfg.max_new_tokens), service="reward")
        self.by_job[job] = ("reward", group.group_id, 0)
        self.log.debug("controller.reward_submitted", group=group.group_id, job=job)

    def _store(self, group: Group, seqs: list[SeqSample], meta: dict) -> None:
        """The one store path of a complete, scored group (single answers or episodes): its rewards join the
        stats, then it is dropped (uniform rewards, with drop_uniform_groups) or put as one Sample."""
        rewards = [s.reward for s in seqs]
        self.rewards.extend(rewards)
        every = np.unique(np.concatenate([np.asarray(s.versions) for s in seqs]))  # sorted
        versions = [int(v) for v in every if v >= 0]  # -1: an episode's environment tokens
        reward_mean = round(sum(rewards) / len(rewards), 4)
        if self.ctl_cfg.drop_uniform_groups:
            uniform, why = uniform_group(rewards, [s.info.get("detail") for s in seqs], self.ctl_cfg.uniform_by)
            if uniform:
                self._drop(group, seqs, reward_mean, versions, why)
                return
        sample = Sample(sample_id=group.group_id, prompt_id=group.problem.id, seqs=seqs,
                        meta={"level": group.problem.level, **meta})
        if self.ctl_cfg.batch_order == "admission":  # put by step(), once its predecessors have left
            self.held[group.group_id] = (sample, reward_mean, versions)
        else:
            self._put(group, sample, reward_mean, versions)

    def _put_in_admission_order(self) -> None:
        """batch_order admission: put the held groups whose predecessors have all left (stored, dropped, failed);
        stop at the first admitted group still generating, scoring or waiting on a full store."""
        while self.admission_order:
            head = self.admission_order[0]
            if head in self.held:
                self._put(self.groups[head], *self.held.pop(head))
            if head in self.groups:
                return
            self.admission_order.popleft()

    def _put(self, group: Group, sample: Sample, reward_mean: float, versions: list[int]) -> None:
        """Store a finished group. A full store (the trainer is behind or stopped) is back-pressure, not a
        loss: the group keeps its place and the put is tried again every STORE_FULL_RETRY_S."""
        try:
            self.store.put(sample)
        except JobFailed as exc:
            if "[store_full]" not in str(exc):
                raise
            if group.unstored is None:
                self.log.warning("controller.store_full", group=group.group_id, error=str(exc)[:300],
                                 retry_in_s=STORE_FULL_RETRY_S)
            group.unstored = (sample, reward_mean, versions)
            self.retry_at.append((time.monotonic() + STORE_FULL_RETRY_S, "store", group.group_id, 0))
            return
        group.unstored = None
        self.groups.pop(group.group_id, None)
        self.ledger.settle(group.group_id, "stored")
        self.stored += 1
        self.log.info("controller.group_stored", group=group.group_id, reward_mean=reward_mean, versions=versions,
                      latency_s=round(time.monotonic() - group.submitted_at, 2))
        self.save_state()

    def _drop(self, group: Group, seqs: list[SeqSample], reward_mean: float, versions: list[int],
              reason: str = "uniform_reward") -> None:
        """A uniform group (rewards/shaping.py `uniform_group`): not stored, and no longer counted against the bound
        (admission replaces it)."""
        self.groups.pop(group.group_id, None)
        self.ledger.settle(group.group_id, "dropped_uniform")
        self.dropped += 1
        bucket = length_bucket(max(len(s.output_ids) for s in seqs))
        self.dropped_by_length[bucket] = self.dropped_by_length.get(bucket, 0) + 1
        self.log.info("controller.group_dropped", group=group.group_id, reason=reason,
                      reward_mean=reward_mean, versions=versions, length_bucket=bucket)
        self.save_state()

    @property
    def submitted(self) -> int:
        """Groups that count against the staleness bound: in flight or stored (to be trained)."""
        return self.ledger.counted

    def poll_store_drops(self, every_s: float = 2.0) -> None:
        """Settle the groups the sample store dropped as stale (they will never be trained)."""
        now = time.monotonic()
        if now < self._next_store_poll:
            return
        self._next_store_poll = now + every_s
        try:
            store_stats = self.store.stats(timeout=5.0)
            dropped, self.store_depth = store_stats.get("dropped_recent", []), store_stats.get("pending", 0)
        except Exception as exc:  # a store restarting: ask again next time
            self.log.warning("controller.store_stats_failed", error=str(exc)[:200])
            return
        settled = [sid for sid, _reason in dropped if self.ledger.settle(sid, "stale")]
        if settled:
            self.log.info("controller.groups_stale", groups=settled[:20], count=len(settled),
                          submitted=self.submitted)
            self.save_state()

    # ------------------------------------------------------------ state
    def on_ready(self, ready: Any) -> None:
        """A WeightsReady from the bus. A restarted bus that lost its retained version replays (0, "base"):
        that is no real version going back, so once a real version was seen it is ignored. A real older
        version (mode disk/zmq: a trainer resumed from a checkpoint) is followed."""
        if ready.mode == "base" and self.version > 0:
            self.log.info("controller.base_replay_ignored", version=self.version)
            return
        self.advisor.weights(ready.meta)
        self.on_weights(ready.version)

    def on_weights(self, version: int) -> None:
        if version != self.version:  # lower after a trainer resumed from a checkpoint
            self.version = version
            self.log.info("controller.version", version=version, submitted=self.submitted, stored=self.stored)
            if self.evaluation is not None:
                self.evaluation.on_version(version)

    def save_state(self) -> None:
        state = {"dataset": self.dataset.state_dict(), "submitted": self.submitted, "next_group": self.next_group,
                 "in_flight_problems": [g.problem.id for g in self.groups.values()], "ledger": self.ledger.state()}
        tmp = self.state_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(state))
        tmp.replace(self.state_path)

    def load_state(self) -> list[str]:
        """Resume: dataset position and the problems whose groups were in flight (to be generated again)."""
        if not self.state_path.exists():
            return []
        state = json.loads(self.state_path.read_text())
        self.dataset.load_state_dict(state["dataset"])
        self.ledger.restore(state.get("ledger") or {"counted": state["submitted"] - len(state["in_flight_problems"])})
        self.next_group = state.get("next_group", state["submitted"])
        return state["in_flight_problems"]

    def stats(self) -> dict:
        size = self.ctl_cfg.group_size
        self.advisor.tick(self.log, in_flight_seqs=sum(size - len(g.results) for g in self.groups.values()),
                          gen_tokens=self.gen_tokens, completed=self.stored * size, version=self.version,
                          store_depth=self.store_depth * size)  # the store counts groups
        elapsed = max(1e-6, time.monotonic() - self.started)
        recent = self.rewards[-200:]
        return {"version": self.version, "submitted": self.submitted, "stored": self.stored, "failed": self.failed,
                "dropped": self.dropped, "dropped_by_length": dict(self.dropped_by_length),
                # DAPO reports it: groups sampled (trained + dropped by dynamic sampling) per group trained
                "sampled_per_trained": round((self.stored + self.dropped) / self.stored, 3) if self.stored else None,
                "ledger": self.ledger.balance(),
                "in_flight": len(self.groups), "held": len(self.held), "gen_tokens": self.gen_tokens, "gen_tokens_per_s": round(self.gen_tokens / elapsed, 2),
                "reward_mean": round(sum(recent) / len(recent), 4) if recent else None,
                # 1 while η alone stops admission (no concurrency cap in the question)
                "eta_blocked": int(not can_admit(self.submitted, self.version, self.cfg.staleness_bound,
                                                 self.ctl_cfg.batch_groups, 0, 1))}

    # ------------------------------------------------------------ loop
    def step(self, timeout: float = 0.05) -> None:
        """One round: admit (unless paused), collect answers, run due retries."""
        if not self.paused:
            self.admit()
        for job_id, msg in self.jobs.poll(timeout):
            self.on_answer(job_id, msg)
        self._run_retries()
        if self.admission_order:  # the one place held groups are put: after this round's answers and retries
            self._put_in_admission_order()
        self.poll_store_drops()

    def done(self) -> bool:
        return self.version >= self.ctl_cfg.total_steps

    # ------------------------------------------------------------ loop hooks
    def on_signal(self, msg: Any) -> None:
        if isinstance(msg, WeightsReady):
            self.on_ready(msg)

    def on_tick(self) -> bool:
        self.step()  # waits up to 0.05 s for answers
        return True

    def should_stop(self, stopping: bool) -> bool:
        return stopping or self.done()

    def on_stop(self) -> None:
        if self.evaluation is not None:
            self.evaluation.stop()
        self.log.info("controller.finished", **self.stats())


def _formatter(cfg: Any) -> Any:
    """Prompt -> token ids: the model's chat template, or with simulated GPUs a stand-in (areal_mq/sim/prompts.py)."""
    if cfg.rollout.engine.kind == "sim":
        from areal_mq.sim.prompts import SimFormatter

        return SimFormatter()
    from areal_mq.data.prompts import ChatFormatter
    from areal_mq.engines.models import load_tokenizer, resolve_model

    tokenizer = load_tokenizer(resolve_model(cfg.model.name, cfg.model.cache_dir))
    return ChatFormatter(tokenizer, cfg.data.system_prompt, cfg.data.examples)


def main(cfg: Any, worker_id: str | None = None) -> int:
    from areal_mq.client import JobClient, StoreClient
    from areal_mq.data import build_dataset
    from areal_mq.actor.runtime import WorkerRuntime
    from areal_mq.workers.controller_eval import RolloutEval

    rt = WorkerRuntime(cfg, role="controller", service=None, capacity=0, worker_id=worker_id)
    b = cfg.brokers
    services = ("generate", "reward", *(["agent"] if cfg.agent.workflow else []))
    jobs = JobClient(b.job_addr, keys=rt.keys, heartbeat_s=b.heartbeat_s, liveness=b.liveness,
                     retry_s=cfg.job_retry_s(*services), log=rt.log)
    store = StoreClient(b.store_addr, keys=rt.keys, heartbeat_s=b.heartbeat_s)
    try:
        formatter = _formatter(cfg)
        ctl = Controller(cfg, build_dataset(cfg.data), formatter, jobs, store, rt.log, rt,
                         evaluation=RolloutEval.from_config(cfg, formatter, jobs, rt.log))
        replay = ctl.load_state()
        initial = rt.start()
        if initial is not None:
            ctl.on_ready(initial)
        for problem_id in replay:  # groups that were in flight when the previous run stopped
            problem = next((p for p in ctl.dataset.problems if p.id == problem_id), None)
            if problem is not None:
                ctl._start_group(problem)
        rt.log.info("controller.started", mode=cfg.run.mode, version=ctl.version, resumed_groups=len(replay),
                    dataset_size=len(ctl.dataset))
        RoleLoop(rt, ctl).run()
        return 0
    finally:
        jobs.close()
        store.close()
        rt.close()
