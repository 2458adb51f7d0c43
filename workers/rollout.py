"""`areal-mq worker rollout`: take GenerateRequests, generate with the engine, reply GenerateResults.

A Role on the shared loop (areal_mq/actor/roles.py; one thread drives the engine, the runtime's I/O thread keeps
heartbeats going):

    on_signal(WeightsReady) ──► the newest of those queued: fetched on a thread while the engine decodes (a
                                 delta when it holds the base, areal_mq/weights/catchup.py), then applied at a step
                                 boundary (the engine pauses only for update_weights); idle: fetched and applied at once;
                                 cuda_ipc (colocated): nothing to fetch, one device copy from the trainer's shared
                                 buffers at a step boundary (areal_mq/weights/ipc.py)
    on_job(GenerateRequest) ──► engine.submit  (held until the engine reaches `min_version`)
    pinned (pin_version N: eval.via rollout) ──► started only at exactly N (held below it, Error(version_passed)
                                 past it); while pinned requests run, and PIN_LINGER_S after, a newer version is
                                 fetched but not applied, bounded (workers/rollout_pins.py)
    rollout.interruptible false ──► an update waits (fetched) until the sequences in flight finish, and the
                                 requests that arrive meanwhile wait for it: every sequence has one version
    on_tick ──► engine.step() ──► finished sequences ──► GenerateResult to the controller
                              └──► streamed requests (GenerateRequest.stream) ──► GeneratePartial, bounded
                                   (workers/rollout_stream.py; a view: the GenerateResult still has every token)
    paused (Control pause) ──► Engine.pause: in-flight sequences wait; the broker sends nothing new

Invariants: capacity = the engine's concurrent-sequence budget, so the broker never sends more than the
engine can run; every job is answered (result, or Error for a bad request); on SIGTERM the worker stops
taking jobs, finishes what it runs within the drain timeout, and hands the rest back to the broker.
A worker that joins late loads the retained weights before it announces READY.
- a sequence the engine could not finish properly (a broken vLLM stream: an error, versions < 0, NaN
  logprobs) is answered Error(job_failed), never as a result the store would take;
- weights are never silently wrong: deltas and full tensors are checked against the trainer's checksums; a
  mismatch, a missing or corrupt delta, or a base it does not hold makes it take another way (full), logged
  as rollout.weights_fallback with the reason; rollout.weights_updated carries engine_pause_s (the engine
  stopped) and transfer_s (announcement taken up to applied) separately;
- a LoRA version whose WeightsAdapter.base_checksum names another base than the engine's (lora.base_identity of
  its model directory, computed once, at the first such version) is refused before anything is fetched
  (WeightsLoadError): that version is lost, not the worker;
- a failed weight load is retried WEIGHTS_LOAD_ATTEMPTS times with doubling pauses (generation goes on
  meanwhile); when it still fails, the requests held for that version are answered
  Error(weights_unavailable) (retryable: the controller resubmits) instead of waiting for ever;
- every token of a pinned answer carries its pinned version: the worker applies no other version while it runs
  (unless the pin's bound expires: then the answer carries two versions and the controller skips that evaluation);
- a bus replay of (0, "base") after a broker restart is ignored (versions never go back on it); a real
  older version (a trainer resumed from a checkpoint) is loaded.

    areal-mq worker rollout --config configs/quickstart.yaml
"""
from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np

from areal_mq.errors import ArealError, EngineRequestError, WeightsBaseMismatch, WeightsLoadError, WeightsRefused
from areal_mq.messages import GenerateRequest, GenerateResult, WeightsReady
from areal_mq.actor.roles import Role, RoleLoop
from areal_mq.weights.disk import engine_base_checksum
from areal_mq.weights.catchup import WeightCatchup
from areal_mq.weights.ipc import IpcReceiver
from areal_mq.workers.rollout_pins import PinnedRequests, pin_hold_limit_s
from areal_mq.workers.rollout_stream import StreamedRequests

# A failed weight load is tried again after 0.5, 1, 2 s (doubling, at most WEIGHTS_RETRY_MAX_S) up to
# WEIGHTS_LOAD_ATTEMPTS tries in all; then the requests held for that version get Error(weights_unavailable).
WEIGHTS_LOAD_ATTEMPTS = 4
WEIGHTS_RETRY_BASE_S = 0.5
WEIGHTS_RETRY_MAX_S = 8.0


def broken_output(out: Any) -> str | None:
    """Why an engine output must not be replied as a result (None when it is sound)."""
    if out.stats.get("error"):
        return str(out.stats["error"])
    n = len(out.output_ids)
    if len(out.logprobs) != n or len(out.versions) != n:
        return f"{n} tokens but {len(out.logprobs)} logprobs and {len(out.versions)} versions"
    if n and (np.asarray(out.versions) < 0).any():
        return "tokens without a policy version"
    if not np.isfinite(np.asarray(out.logprobs, dtype=np.float64)).all():
        return "non-finite logprobs"
    return None


FETCHED_MODES = ("disk", "zmq")  # publish modes a worker fetches on a thread (cuda_ipc is applied, not fetched)


class RolloutWorker(Role):
    name = "rollout"

    def __init__(self, cfg: Any, engine: Any, runtime: Any, clock: Any = time.monotonic):
        super().__init__(runtime)
        self.cfg, self.engine, self.clock = cfg, engine, clock
        self.drain_timeout_s = cfg.rollout.drain_timeout_s
        self.jobs: dict[str, Any] = {}  # request id -> Job
        self.held: list[Any] = []  # jobs waiting for min_version
        # rollout.interruptible false: requests that arrived while an update waits for the running ones to finish
        self.interruptible = cfg.rollout.interruptible
        self.deferred: list[Any] = []
        self.tokens = 0
        # measured decode speed per row against the generate lease (cfg.job_leases): a max_new_tokens answer at
        # the measured rate must finish inside it, or the broker takes long answers back (rollout.lease_too_short)
        self.started: dict[str, float] = {}  # request id -> submit time
        self.row_tokens_per_s = 0.0  # moving average over finished requests of >= 16 tokens
        self.lease_s = cfg.job_leases().get("generate", 0.0)
        self.lease_warned_at = float("-inf")
        # weight updates: count, engine pause seconds (sum), sequences interrupted, KV tokens recomputed
        self.updates = {"weight_updates": 0, "update_pause_s": 0.0, "interrupted_seqs": 0, "recompute_tokens": 0}
        self.retry_load: tuple[WeightsReady, int, float] | None = None  # (ready, next attempt, due at)
        self.unloadable: WeightsReady | None = None  # the last announcement whose load finally failed
        self.announced: WeightsReady | None = None  # the newest announcement not loaded yet
        self.fetching: _Fetch | None = None  # a fetch running on a thread while the engine decodes
        self.catchup = WeightCatchup(cfg.run.run_dir, cfg.trainer, cfg.rollout.weights_timeout_s, runtime.keys,
                                     min_mbps=cfg.rollout.weights_min_mbps, base_checksum=engine_base_checksum(engine))
        self.ipc = IpcReceiver(cfg.run.run_dir, cfg.rollout.weights_timeout_s)  # trainer.publish_mode cuda_ipc
        self.pins = PinnedRequests(pin_hold_limit_s(cfg), clock)  # pinned requests (eval.via rollout) hold updates
        self.streams = StreamedRequests(getattr(engine, "progress", lambda rid: None))  # stream: true requests

    # ------------------------------------------------------------ weights
    def load(self, ready: WeightsReady, attempt: int = 1) -> None:
        """Fetch and apply `ready` now (at start-up, on a retry, or when the engine is idle)."""
        if not self._wanted(ready):
            return
        t0 = time.perf_counter()
        try:
            update = stage(self.catchup.prepare(ready), self._stager())
        except ArealError as exc:
            self._fetch_failed(ready, attempt, exc)
            return
        self.apply(ready, update, t0, attempt)

    def _stager(self) -> Any:
        """The engine's stage_patches (checks and conversions of a patch update, done off the pause) and stage_adapter
        (a LoRA version merged from the kept base, off the pause), each None where the engine has none."""
        patches = getattr(self.engine, "stage_patches", None) if getattr(self.engine, "accepts_patches", False) else None
        adapters = getattr(self.engine, "stage_adapter", None) if getattr(self.engine, "accepts_adapters", False) else None
        return patches, adapters

    def _audit_weights(self, version: int) -> None:
        """rollout.audit_weights: the checksum (weights/delta.py's, of the bytes in the published dtype) of every
        tensor the engine holds now, so an audit can check them against what the trainer published."""
        model = getattr(self.engine, "model", None)
        if model is None or not hasattr(model, "state_dict"):
            return  # an engine whose weights live elsewhere (vLLM's workers, a simulated engine)
        import torch

        from areal_mq.weights.delta import checksum

        dtype = getattr(torch, self.cfg.trainer.publish_dtype)
        sums = {k: checksum(t.detach().to(device="cpu", dtype=dtype).contiguous())
                for k, t in model.state_dict().items()}
        self.log.info("rollout.weights_audit", version=version, checksums=sums)

    def _wanted(self, ready: WeightsReady) -> bool:
        # "base" = nothing published yet, or a restarted bus's replay: never a version going back.
        # A lower real version is loaded: the trainer resumed from a checkpoint.
        if ready.mode == "base" or ready.version == self.engine.version:
            return False
        self.retry_load = None  # this announcement supersedes a pending retry of an older one
        return True

    def start_fetch(self, ready: WeightsReady, attempt: int = 1) -> None:
        """Fetch `ready` on a thread while the engine keeps decoding; on_tick applies it once it is there."""
        if self._wanted(ready):
            self.fetching = _Fetch(self.catchup, ready, attempt, self._stager())

    def finish_fetch(self) -> None:
        fetch = self.fetching
        if fetch is None or not fetch.done.is_set():
            return
        if fetch.error is None and not self.interruptible and self.jobs:
            return  # not interruptible: the fetched update waits until the sequences in flight finish
        if fetch.error is None and self._pinned_hold():
            return  # pinned requests run at the engine's version: the update waits for them
        self.fetching = None
        if fetch.error is not None:
            self._fetch_failed(fetch.ready, fetch.attempt, fetch.error)
        else:
            self.apply(fetch.ready, fetch.update, fetch.t0, fetch.attempt)

    def _fetch_failed(self, ready: WeightsReady, attempt: int, exc: BaseException) -> None:
        if isinstance(exc, WeightsRefused):  # the bus checks this too; a worker never reads outside its run
            self.log.error("rollout.weights_refused", version=ready.version, error=str(exc))
            self.fail_held(ready.version, str(exc))
        elif isinstance(exc, ArealError):  # a base mismatch stays one however often it is fetched: no retry
            self._load_failed(ready, attempt, str(exc), final=isinstance(exc, WeightsBaseMismatch))
        else:
            raise exc

    def apply(self, ready: WeightsReady, update: Any, t0: float, attempt: int = 1) -> None:
        """Load a fetched update into the engine: the only part that pauses decoding."""
        running = len(self.jobs)
        if update.fallback:
            self.log.warning("rollout.weights_fallback", version=ready.version, base=ready.base, route=update.route,
                             reason=update.fallback.split(":", 1)[0], detail=update.fallback[:500],
                             failures=[f[:300] for f in update.failures])
        t1 = time.perf_counter()
        try:
            if ready.mode == "cuda_ipc":  # colocated: one device copy from the trainer's shared buffers
                timings = self.ipc.update(self.engine, ready)
            elif (update.patches is not None and getattr(self.engine, "accepts_patches", False)
                  and self.engine.version == update.patch_base):  # the engine holds the diff's base: write what changed
                timings = {**self.engine.update_weights(ready.version, patches=update.patches), "applied": "patches"}
            else:
                timings = {**self.engine.update_weights(ready.version, **update.kwargs),
                           "applied": "adapter" if update.adapter is not None else "full"}
        except ArealError as exc:
            self._load_failed(ready, attempt, str(exc))
            return
        t2 = time.perf_counter()
        self.pins.applied()
        self.catchup.commit(update)
        self.unloadable = None
        fields = {k: round(v, 4) if isinstance(v, float) else v for k, v in timings.items()}
        fields.update(version=ready.version, mode=ready.mode, running=running, route=update.route,
                      fetched_bytes=update.fetched_bytes, full_bytes=update.full_bytes,
                      fetch_s=round(update.fetch_s, 4), engine_pause_s=round(t2 - t1, 4),
                      transfer_s=round(t2 - t0, 4), total_s=round(t2 - t0, 3))
        self.log.info("rollout.weights_updated", **fields)
        if self.cfg.rollout.audit_weights:
            self._audit_weights(ready.version)
        for key, add in (("weight_updates", 1), ("update_pause_s", t2 - t1), ("interrupted_seqs", running),
                         ("recompute_tokens", int(timings.get("recompute_tokens", 0)))):
            self.updates[key] += add

    def _load_failed(self, ready: WeightsReady, attempt: int, error: str, final: bool = False) -> None:
        if attempt < WEIGHTS_LOAD_ATTEMPTS and not final:
            delay = min(WEIGHTS_RETRY_MAX_S, WEIGHTS_RETRY_BASE_S * 2 ** (attempt - 1))
            self.log.warning("rollout.weights_retry", version=ready.version, attempt=attempt, error=error,
                             retry_in_s=delay)
            self.retry_load = (ready, attempt + 1, self.clock() + delay)
            return
        self.log.error("rollout.weights_failed", version=ready.version, attempts=attempt, error=error)
        self.unloadable = ready
        self.fail_held(ready.version, error)

    def retry_load_if_due(self) -> None:
        if self.retry_load is not None and self.fetching is None and self.clock() >= self.retry_load[2]:
            ready, attempt, _ = self.retry_load
            self.retry_load = None
            self.take(ready, attempt)

    def take(self, ready: WeightsReady, attempt: int = 1) -> None:
        """Load `ready`: on a thread while the engine has sequences to decode (or pinned requests hold updates), else
        at once."""
        if (self.engine.has_work() or self._pinned_hold()) and ready.mode in FETCHED_MODES:
            self.start_fetch(ready, attempt)
        else:
            self.load(ready, attempt)

    def _pinned_hold(self) -> bool:
        """An update must wait for the pinned requests (rollout_pins.py); logs once when their bound expired."""
        if self.pins.holding():
            return True
        if self.pins.expired and self.pins.running:
            self.log.warning("rollout.pin_hold_expired", pinned=len(self.pins.running), version=self.engine.version,
                             limit_s=round(self.pins.limit_s, 1),
                             hint="the pinned answers will carry two versions: the controller skips that evaluation")
            self.pins.expired = False
        return False

    def update_waiting(self) -> bool:
        """Not interruptible, and an update is announced or fetched: new requests wait until it is applied."""
        return not self.interruptible and (self.fetching is not None or self.announced is not None)

    def release_deferred(self) -> None:
        if self.deferred and not self.update_waiting():
            jobs, self.deferred = self.deferred, []
            for job in jobs:
                self._submit(job)

    def fail_held(self, version: int, error: str) -> None:
        """Answer the requests held for `version` (or older) with a retryable error: it will not come."""
        stranded = [j for j in self.held if _waits_for(j.msg) <= version]
        self.held = [j for j in self.held if _waits_for(j.msg) > version]
        for job in stranded:
            self.rt.fail(job, "weights_unavailable",
                         f"policy version {version} could not be loaded on {self.rt.worker_id} ({error[:300]}); "
                         "resubmit: another worker, or a later version, can serve it")

    def on_signal(self, msg: Any) -> None:
        if isinstance(msg, WeightsReady):
            # loaded at the next step boundary (on_tick); of several queued announcements (a worker that was
            # cut off, or slower than the trainer) only the newest is loaded: the older ones may be pruned
            self.announced = msg

    # ------------------------------------------------------------ jobs
    def on_job(self, job: Any) -> None:
        msg = job.msg
        if not isinstance(msg, GenerateRequest):
            self.rt.fail(job, "bad_request", f"a rollout worker takes generate_request, got {msg.kind.value}")
            return
        if msg.pin_version is not None and msg.pin_version < self.engine.version:
            self._refuse_passed(job)
            return
        if _waits_for(msg) > self.engine.version:
            self.held.append(job)
            bad = self.unloadable
            if bad is not None and self.retry_load is None and _waits_for(msg) <= bad.version:
                self.retry_load = (bad, 1, self.clock())  # a resubmit: try that version afresh
            return
        self._submit(job)

    def _refuse_passed(self, job: Any) -> None:
        self.rt.fail(job, "version_passed",
                     f"request pinned to policy version {job.msg.pin_version}, and {self.rt.worker_id} holds version "
                     f"{self.engine.version}: that version has passed here (not retryable at that version)")

    def _submit(self, job: Any) -> None:
        from areal_mq.engines.base import EngineRequest

        msg = job.msg
        pinned = msg.pin_version is not None
        if pinned and msg.pin_version != self.engine.version:  # released after the worker jumped past the pin
            self._refuse_passed(job)
            return
        if self.update_waiting() and not pinned:  # a pinned request runs now, at its version, and holds the update
            self.deferred.append(job)
            return
        try:
            self.engine.submit(EngineRequest(job.id, [int(t) for t in msg.prompt_ids], msg.sampling,
                                             session=msg.session))
        except EngineRequestError as exc:
            self.rt.fail(job, "bad_request", str(exc))
            return
        self.jobs[job.id] = job
        self.started[job.id] = self.clock()
        if pinned:
            self.pins.started(job.id, msg.pin_version)
        self.streams.started(job)
        self.log.debug("rollout.request_started", job=job.id, prompt_len=len(msg.prompt_ids),
                       version=self.engine.version)

    def release_held(self) -> None:
        if not self.held:
            return
        ready = [j for j in self.held if _waits_for(j.msg) <= self.engine.version]
        self.held = [j for j in self.held if _waits_for(j.msg) > self.engine.version]
        for job in ready:
            self._submit(job)

    def step(self) -> None:
        for out in self.engine.step():
            job = self.jobs.pop(out.request_id, None)
            started = self.started.pop(out.request_id, None)
            self.pins.finished(out.request_id)
            self.streams.finished(out.request_id)
            if job is None:
                continue
            if started is not None:
                self._measure(len(out.output_ids), self.clock() - started)
            if (why := broken_output(out)) is not None:
                self.rt.fail(job, "job_failed", f"generation failed on {self.rt.worker_id}: {why[:500]}")
                continue
            self.tokens += len(out.output_ids)
            self.rt.reply(job, GenerateResult(
                output_ids=out.output_ids, logprobs=out.logprobs, versions=out.versions,
                finish_reason=out.finish_reason, text=out.text, worker_id=self.rt.worker_id,
                group_id=job.msg.group_id, sample_index=job.msg.sample_index, stats=out.stats))
            self.log.debug("rollout.request_finished", job=job.id, tokens=len(out.output_ids),
                           reason=out.finish_reason, versions=np.unique(out.versions).tolist(),  # 30x a set
                           group=job.msg.group_id, sample=job.msg.sample_index,
                           version_counts=np.unique(out.versions, return_counts=True)[1].tolist())
        if self.streams:
            for job, partial in self.streams.due(self.clock()):
                self.rt.partial(job, partial)

    def _measure(self, tokens: int, seconds: float) -> None:
        """Fold one finished request's decode speed (queueing included: what the lease sees) into the average and
        warn, at most once a minute, when a max_new_tokens answer at that speed would outlive the generate lease."""
        if tokens < 16 or seconds <= 0:
            return
        rate = tokens / seconds
        self.row_tokens_per_s = rate if not self.row_tokens_per_s else 0.8 * self.row_tokens_per_s + 0.2 * rate
        longest = self.cfg.controller.max_new_tokens / self.row_tokens_per_s
        now = self.clock()
        if self.lease_s > 0 and longest > self.lease_s and now - self.lease_warned_at > 60.0:
            self.lease_warned_at = now
            self.log.warning("rollout.lease_too_short", row_tokens_per_s=round(self.row_tokens_per_s, 2),
                             max_new_tokens=self.cfg.controller.max_new_tokens, longest_answer_s=round(longest, 1),
                             generate_lease_s=round(self.lease_s, 1),
                             hint="the job broker takes back an answer still decoding at its lease: set "
                                  f"brokers.min_decode_tokens_per_s <= {self.row_tokens_per_s:.2f} (the lease is 60 s "
                                  "+ max_new_tokens / it) or brokers.job_deadlines.generate")

    def stats(self) -> dict:
        fields = {k: v for k, v in self.engine.stats().items() if isinstance(v, (int, float))}
        fields.update(running=len(self.jobs), pinned=len(self.pins.running), held=len(self.held),
                      deferred=len(self.deferred), tokens=self.tokens, row_tokens_per_s=round(self.row_tokens_per_s, 3),
                      occupancy=round(len(self.jobs) / max(1, self.capacity), 3), **self.updates)
        return fields

    # ------------------------------------------------------------ loop hooks
    def on_tick(self) -> bool:
        self.finish_fetch()
        # not interruptible: a cuda_ipc update (applied, not fetched) is taken once nothing runs; pinned requests
        # hold it too (a fetched one is fetched now and waits in finish_fetch)
        if self.announced is not None and self.fetching is None and (self.announced.mode in FETCHED_MODES or (
                (self.interruptible or not self.jobs) and not self._pinned_hold())):
            ready, self.announced = self.announced, None
            self.take(ready)
        self.retry_load_if_due()
        self.release_deferred()
        self.release_held()
        if self.paused or not self.engine.has_work():
            return False
        self.step()
        return True

    def busy(self) -> bool:
        return bool(self.jobs) or self.fetching is not None

    def on_pause(self, paused: bool) -> None:
        self.engine.pause() if paused else self.engine.resume()

    def on_stop(self) -> None:
        for rid in list(self.jobs):  # left over: abort here, the broker requeues them on DISCONNECT
            self.engine.abort(rid)
            self.streams.finished(rid)
        self.log.info("rollout.drained", handed_back=len(self.jobs) + len(self.held) + len(self.deferred))


def _waits_for(msg: GenerateRequest) -> int:
    """The version a request waits for: its pin (exactly that one), else its minimum."""
    return msg.pin_version if msg.pin_version is not None else msg.min_version


def stage(update: Any, stagers: tuple[Any, Any]) -> Any:
    """`update` with its patches staged for the engine (checked and converted on this thread, so the engine's pause is
    only the scatter), or its LoRA adapter merged from the engine's base (WeightsLoadError where the engine takes no
    adapters); unchanged when there are no patches or the engine stages nothing."""
    patches, adapters = stagers
    if update.adapter is not None:
        if adapters is None:
            raise WeightsLoadError(f"v{update.version} is a LoRA adapter (trainer.lora) and this rollout engine takes "
                                   "no adapters: use engine.kind torch, or vllm with trainer.lora in the run's config")
        update.kwargs = {"adapter": adapters(update.kwargs["tensors"], update.adapter.scaling, update.adapter.rank)}
    elif patches is not None and update.patches is not None:
        update.patches = patches(update.patches)
    return update


class _Fetch:
    """One WeightCatchup.prepare on a daemon thread (zstd, blake2b and socket waits release the GIL, so decoding
    goes on). The thread only fetches and decodes; the worker's thread applies and commits."""

    def __init__(self, catchup: WeightCatchup, ready: WeightsReady, attempt: int, stager: Any = (None, None)):
        self.ready, self.attempt, self.t0, self.stager = ready, attempt, time.perf_counter(), stager
        self.update: Any = None
        self.error: BaseException | None = None
        self.done = threading.Event()
        threading.Thread(target=self._run, args=(catchup,), name=f"weights-v{ready.version}", daemon=True).start()

    def _run(self, catchup: WeightCatchup) -> None:
        try:
            self.update = stage(catchup.prepare(self.ready), self.stager)
        except BaseException as exc:  # handed to the worker's thread, which logs or re-raises it
            self.error = exc
        finally:
            self.done.set()


def main(cfg: Any, worker_id: str | None = None) -> int:
    from areal_mq.devices import role_device
    from areal_mq.engines import build_engine
    from areal_mq.actor.runtime import WorkerRuntime
    from areal_mq.actor.threads import apply_thread_budget

    apply_thread_budget(cfg, "rollout")
    rt = WorkerRuntime(cfg, role="rollout", service="generate", capacity=cfg.rollout.engine.max_concurrent,
                       worker_id=worker_id)
    engine = None
    try:
        t0 = time.perf_counter()
        engine = build_engine(cfg.rollout.engine, cfg.model, seed=cfg.run.seed, device=role_device(cfg, "rollout"))
        rt.log.info("rollout.engine_ready", engine=cfg.rollout.engine.kind, model=cfg.model.name,
                    load_s=round(time.perf_counter() - t0, 2))
        worker = RolloutWorker(cfg, engine, rt)
        initial = rt.start()
        if initial is not None:
            worker.load(initial)
        rt.ready()
        RoleLoop(rt, worker).run()
        return 0
    except ArealError as exc:
        rt.log.error("rollout.failed", error=str(exc))
        return 1
    finally:
        rt.close(drain_timeout=0.0)
        if engine is not None:
            engine.close()
