"""RewardExecutor: score RewardJobs concurrently in a pool of processes, never losing a job.

What: `submit(job, job_id) -> Future[RewardResult]`. A job is split into calls (one per completion for
per-sample functions, one for the whole group for group functions), each run in one of `processes`
pool processes under the `timeout_s` deadline. A call that raises, hangs (its process is killed and
replaced) or crashes its process is retried up to `retries` times, then yields the task's default
reward plus an error string in RewardResult.errors and a record passed to `on_error`:
    {"job": id, "task": ..., "indices": [...], "kind": "exception|timeout|crashed|http", "error": "...",
     "attempts": n, "traceback": "..."}
Idempotent by job id (a resubmitted id returns the first Future or the stored result); good rewards
are cached (LRU) on (task, prompt id, completion, truncated). HTTP tasks go to their HttpRewardBridge
on threads instead of the pool.

    submit --> _pending --> dispatcher thread --> pool process (pipe) --> _finish_call --> Future
                                  +--> deadline passed: kill process group, start a new process, retry

Run: see tests/unit/rewards/test_executor.py; `with RewardExecutor(RewardConfig()) as ex: ex.score(job)`.
"""
from __future__ import annotations

import hashlib
import multiprocessing as mp
import pickle
import threading
import uuid
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable

from areal_mq.errors import ConfigError, RewardError
from areal_mq.messages import RewardJob, RewardResult
from areal_mq.rewards.cache import LRU
from areal_mq.rewards.config import RewardConfig, TaskConfig
from areal_mq.rewards.http_bridge import HttpRewardBridge
from areal_mq.rewards.registry import RewardRegistry
from areal_mq.rewards.slots import SlotPool


# What every call passes itself: a job's meta never sets these (a clash would fail the call with a TypeError).
_CALL_NAMES = frozenset({"prompt", "completion", "completions", "reference", "prompt_id", "truncated"})


@dataclass
class TaskPlan:
    """How one task is scored, resolved once per executor."""

    task: str
    fns: list  # [(ref, weight or None)]
    group: bool
    kwargs: dict
    default: float
    bridge: HttpRewardBridge | None = None
    protected: frozenset = frozenset()  # keys a job's meta may not set: declared parameters, kwargs, _CALL_NAMES


@dataclass
class Call:
    """One unit of pool work: some completions of one job."""

    id: int
    job_id: str
    plan: TaskPlan
    indices: list[int]
    args: tuple  # (prompt, completion or completions, reference, meta)
    keys: list  # cache key per result
    attempts: int = 0


@dataclass
class RewardJobState:
    job_id: str
    job: RewardJob
    plan: TaskPlan
    future: Future
    rewards: list
    details: list
    errors: list
    left: int = 0
    all_cached: bool = True
    calls: list = field(default_factory=list)


class RewardExecutor:
    """Process pool for reward functions; see the module docstring. Use as a context manager."""

    def __init__(self, cfg: RewardConfig, registry: RewardRegistry | None = None, *,
                 on_error: Callable[[dict], None] | None = None, worker_id: str = ""):
        self.cfg = cfg
        self.registry = registry or RewardRegistry()
        self.worker_id = worker_id
        self._on_error = on_error
        self._lock = threading.Lock()
        self._plans: dict[str, TaskPlan] = {}
        self._jobs: dict[str, RewardJobState] = {}
        self._done = LRU(max(cfg.cache_size, 1024))
        self._cache = LRU(cfg.cache_size)
        self._pending: deque[Call] = deque()
        self._next_call = 0
        self._http: ThreadPoolExecutor | None = None
        self.counters = {"jobs": 0, "calls": 0, "retries": 0, "timeouts": 0, "crashes": 0, "exceptions": 0,
                         "failed_calls": 0, "duplicates": 0, "cache_hits": 0}
        self._pool: SlotPool | None = None

    # ------------------------------------------------------------------ lifecycle
    def validate(self) -> list[str]:
        """Resolve every configured task (RewardError if one is broken); returns the functions to warm up."""
        warm = []
        for task in self.cfg.tasks:
            warm += [ref for ref, _ in self.plan(task).fns]
        if self.cfg.start_method != "fork":
            try:
                pickle.dumps(self.registry)
            except Exception as exc:
                raise RewardError(f"a registered reward function cannot be sent to a '{self.cfg.start_method}' "
                                  f"pool process ({type(exc).__name__}: {exc}); define it at module level or "
                                  "set reward.start_method: fork") from None
        return warm

    def start(self) -> "RewardExecutor":
        """Validate every configured task, then start the pool processes."""
        warm = self.validate()
        ctx = mp.get_context(self.cfg.start_method)
        self._pool = SlotPool(ctx, self.cfg.processes, self.cfg.timeout_s, self.registry, warm,
                              take=self._take_call, done=self._finish_call, failed=self._call_failed,
                              requeue=self._requeue_call)
        self._pool.start()
        return self

    def close(self) -> None:
        """Stop the pool; jobs still running fail with RewardError (a broker requeues them)."""
        if self._pool is not None:
            self._pool.stop()
        if self._http is not None:
            self._http.shutdown(wait=False, cancel_futures=True)
        with self._lock:
            states = list(self._jobs.values())
            self._jobs.clear()
            self._pending.clear()
        for st in states:
            if not st.future.done():
                st.future.set_exception(RewardError(f"reward executor closed before job {st.job_id} finished"))

    def __enter__(self) -> "RewardExecutor":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def capacity(self) -> int:
        return self.cfg.processes

    def pool_pids(self) -> list[int]:
        """PIDs of the pool processes right now (they change when one is replaced)."""
        return self._pool.pids() if self._pool else []

    def stats(self) -> dict:
        with self._lock:
            return {**self.counters, "in_flight": len(self._jobs), "pending_calls": len(self._pending),
                    "cache_entries": len(self._cache), "processes": self._pool.alive() if self._pool else 0}

    # ------------------------------------------------------------------ tasks
    def plan(self, task: str) -> TaskPlan:
        """How `task` is scored; RewardError when it is unknown or misconfigured.

        A task name comes off the wire: it only selects an entry of this worker's configuration (its own name,
        else '*'). It is never resolved as a registry name or import path (a job naming "os:execl" must not
        run code), and plans are kept per entry, so names a '*' catches share one plan (and one HTTP bridge)."""
        key = task if task in self.cfg.tasks else "*"
        with self._lock:
            hit = self._plans.get(key)
        if hit is not None:
            return hit
        tcfg = self.cfg.tasks.get(key)
        if tcfg is None:
            raise RewardError(f"unknown reward task {str(task)[:80]!r}: this worker serves "
                              f"{sorted(self.cfg.tasks) or 'no tasks'}; define it under reward.tasks")
        plan = self._build_plan(key, tcfg)
        with self._lock:
            plan = self._plans.setdefault(key, plan)
        return plan

    def _build_plan(self, task: str, tcfg: TaskConfig) -> TaskPlan:
        default = self.cfg.default_reward if tcfg.default_reward is None else tcfg.default_reward
        if tcfg.http is not None:
            return TaskPlan(task, [], False, {}, default, bridge=HttpRewardBridge(tcfg.http))
        refs = [(tcfg.fn, None)] if tcfg.fn else list(tcfg.combine.items())
        try:
            resolved = [self.registry.resolve(ref) for ref, _ in refs]
            for fn in resolved:
                fn.check_kwargs(tcfg.kwargs)
        except ConfigError as exc:
            raise RewardError(f"reward task {task!r} is misconfigured: {exc}") from None
        if tcfg.combine and any(fn.group for fn in resolved):
            raise RewardError(f"reward task {task!r}: combine takes per-sample functions only, "
                              f"{[f.name for f in resolved if f.group]} are group functions")
        protected = frozenset().union(_CALL_NAMES, tcfg.kwargs, *(fn.params for fn in resolved))
        return TaskPlan(task, refs, resolved[0].group and not tcfg.combine, dict(tcfg.kwargs), default,
                        protected=protected)

    # ------------------------------------------------------------------ submit
    def submit(self, job: RewardJob, job_id: str | None = None) -> Future:
        """Score `job`; the Future resolves to a RewardResult (never to a function's exception).

        Raises RewardError at once for a job that cannot be scored at all (unknown task, bad flags).
        """
        if self._pool is None:
            raise RewardError("RewardExecutor.start() was not called")
        job_id = job_id or uuid.uuid4().hex
        n = len(job.completions)
        if job.truncated and len(job.truncated) != n:
            raise RewardError(f"job {job_id}: {len(job.truncated)} truncated flags for {n} completions; "
                              "send one flag per completion or none")
        plan = self.plan(job.task)
        with self._lock:
            if job_id in self._jobs:
                self.counters["duplicates"] += 1
                return self._jobs[job_id].future
        done = self._done.get(job_id)
        if done is not None:
            self.counters["duplicates"] += 1
            fut: Future = Future()
            fut.set_result(done.model_copy())
            return fut
        st = RewardJobState(job_id, job, plan, Future(), [None] * n, [{} for _ in range(n)], [None] * n)
        with self._lock:
            self._jobs[job_id] = st
            self.counters["jobs"] += 1
        if plan.bridge is not None:
            return self._submit_http(st)
        self._enqueue(st)
        return st.future

    def score(self, job: RewardJob, job_id: str | None = None, timeout: float | None = None) -> RewardResult:
        """Blocking submit()."""
        return self.submit(job, job_id).result(timeout)

    def _meta(self, st: RewardJobState, truncated) -> dict:
        """Keyword arguments of a call. A job's `meta` comes off the wire: it reaches only a function's `**meta`.
        It may not set a parameter the function declares (e.g. the code reward's `sandbox` limits, arith's reward
        values), a configured kwarg or a name the call passes itself; such keys are dropped, not errors."""
        job_meta = {k: v for k, v in st.job.meta.items() if k not in st.plan.protected}
        return {**job_meta, "prompt_id": st.job.prompt_id, "truncated": truncated, **st.plan.kwargs}

    def _cache_key(self, st: RewardJobState, payload) -> tuple:
        prompt_key = st.job.prompt_id or hashlib.sha1(
            (st.job.prompt + "\x00" + repr(st.job.reference)).encode()).hexdigest()
        return (st.job.task, prompt_key, payload)

    def _enqueue(self, st: RewardJobState) -> None:
        job, n = st.job, len(st.job.completions)
        flags = list(job.truncated) or [False] * n
        groups = [list(range(n))] if st.plan.group else [[i] for i in range(n)]
        calls = []
        for idx in groups:
            if st.plan.group:
                comp, trunc = list(job.completions), flags
            else:
                comp, trunc = job.completions[idx[0]], flags[idx[0]]
            key = self._cache_key(st, (tuple(comp) if st.plan.group else comp, tuple(trunc) if st.plan.group else trunc))
            hit = self._cache.get(key)
            if hit is not None:
                self._store(st, idx, hit)
                with self._lock:
                    self.counters["cache_hits"] += len(idx)
                continue
            st.all_cached = False
            with self._lock:
                self._next_call += 1
                calls.append(Call(self._next_call, st.job_id, st.plan, idx,
                                  (job.prompt, comp, job.reference, self._meta(st, trunc)), [key]))
        st.left = len(calls)
        with self._lock:
            self._pending.extend(calls)
            self.counters["calls"] += len(calls)
        if not calls:
            self._complete(st)
        else:
            self._pool.wake()

    def _submit_http(self, st: RewardJobState) -> Future:
        if self._http is None:
            with self._lock:
                if self._http is None:
                    self._http = ThreadPoolExecutor(max_workers=32, thread_name_prefix="reward-http")

        def run():
            idx = list(range(len(st.job.completions)))
            try:
                out = st.plan.bridge.score(st.job_id, st.job)
            except Exception as exc:  # HttpRewardError, or anything unexpected: default + error record
                self._fail(st, idx, "http", f"{type(exc).__name__}: {exc}", "", attempts=1)
            else:
                self._store(st, idx, out)
            self._complete(st)

        self._http.submit(run)
        return st.future

    # ------------------------------------------------------------------ pool callbacks (dispatcher thread)
    def _take_call(self) -> Call | None:
        with self._lock:
            while self._pending:
                call = self._pending.popleft()
                if call.job_id in self._jobs:
                    call.attempts += 1
                    return call
            return None

    def _requeue_call(self, call: Call) -> None:
        """A call that was sent but never started (its process was killed): run it again, no attempt spent."""
        with self._lock:
            call.attempts -= 1
            self._pending.appendleft(call)

    def _finish_call(self, call: Call, out: list) -> None:
        st = self._jobs.get(call.job_id)
        if st is None:
            return
        if len(out) != len(call.indices):
            self._call_failed(call, "exception", f"returned {len(out)} rewards for {len(call.indices)} completions", "")
            return
        self._cache.put(call.keys[0], out)
        self._store(st, call.indices, out)
        self._call_done(st)

    def _call_failed(self, call: Call, kind: str, error: str, tb: str) -> None:
        st = self._jobs.get(call.job_id)
        if st is None:
            return
        with self._lock:
            self.counters[{"timeout": "timeouts", "crashed": "crashes"}.get(kind, "exceptions")] += 1
            if call.attempts <= self.cfg.retries:
                self.counters["retries"] += 1
                self._pending.appendleft(call)
                return
            self.counters["failed_calls"] += 1
        self._fail(st, call.indices, kind, error, tb, call.attempts)
        self._call_done(st)

    def _call_done(self, st: RewardJobState) -> None:
        with self._lock:
            st.left -= 1
            finished = st.left == 0
        if finished:
            self._complete(st)

    # ------------------------------------------------------------------ results
    def _store(self, st: RewardJobState, indices: list[int], out: list) -> None:
        for i, (reward, details) in zip(indices, out):
            st.rewards[i] = reward
            st.details[i] = details

    def _fail(self, st: RewardJobState, indices, kind, error, tb, attempts) -> None:
        record = {"job": st.job_id, "task": st.job.task, "prompt_id": st.job.prompt_id, "indices": indices,
                  "kind": kind, "error": error, "attempts": attempts, "traceback": tb}
        text = f"{kind}: {error} (job {st.job_id}, {attempts} attempt{'s' * (attempts != 1)})"
        for i in indices:
            st.rewards[i] = st.plan.default
            st.details[i] = {"default_reward": True}
            st.errors[i] = text
        if self._on_error is not None:
            try:
                self._on_error(record)
            except Exception:  # a broken logging hook must not lose the job
                pass

    def _complete(self, st: RewardJobState) -> None:
        result = RewardResult(rewards=st.rewards, details=st.details, errors=st.errors,
                              cached=st.all_cached, worker_id=self.worker_id)
        with self._lock:
            self._jobs.pop(st.job_id, None)
        self._done.put(st.job_id, result)
        if not st.future.done():
            st.future.set_result(result)
