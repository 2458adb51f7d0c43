"""`areal-mq worker rollout`: take GenerateRequests, generate with the engine, reply GenerateResults.

Loop (one thread drives the engine; the runtime's I/O thread keeps heartbeats going):

    signals (WeightsReady, Control) ──► at a step boundary: load weights in place, continue in-flight
    jobs (GenerateRequest) ──────────► engine.submit  (held until the engine reaches `min_version`)
    engine.step() ──────────────────► finished sequences ──► GenerateResult to the controller

Invariants: capacity = the engine's concurrent-sequence budget, so the broker never sends more than the
engine can run; every job is answered (result, or Error for a bad request); on SIGTERM the worker stops
taking jobs, finishes what it runs within the drain timeout, and hands the rest back to the broker.
A worker that joins late loads the retained weights before it announces READY.

    areal-mq worker rollout --config configs/quickstart.yaml
"""
from __future__ import annotations

import time
from typing import Any

from areal_mq.errors import ArealError, EngineRequestError
from areal_mq.messages import Control, GenerateRequest, GenerateResult, WeightsReady


class RolloutWorker:
    def __init__(self, cfg: Any, engine: Any, runtime: Any):
        self.cfg, self.engine, self.rt = cfg, engine, runtime
        self.log = runtime.log
        self.jobs: dict[str, Any] = {}  # request id -> Job
        self.held: list[Any] = []  # jobs waiting for min_version
        self.paused = False
        self.tokens = 0
        self._last_stats = time.monotonic()

    # ------------------------------------------------------------ weights
    def load(self, ready: WeightsReady) -> None:
        if ready.mode == "base" or ready.version == self.engine.version:
            return  # "base" = nothing published yet; a lower version is loaded: the trainer resumed
        from areal_mq.weights import check_ready, load_published

        why = check_ready(ready, self.cfg.run.run_dir, self.cfg.trainer)
        if why:  # the bus checks this too; a worker never reads a path or endpoint outside its run
            self.log.error("rollout.weights_refused", version=ready.version, error=why)
            return

        t0 = time.perf_counter()
        running = len(self.jobs)
        try:
            if ready.mode == "disk":
                timings = self.engine.update_weights(ready.version, path=ready.path)
            else:
                tensors = load_published(ready, timeout_s=self.cfg.rollout.weights_timeout_s, keys=self.rt.keys)
                timings = self.engine.update_weights(ready.version, tensors=tensors)
        except ArealError as exc:
            self.log.error("rollout.weights_failed", version=ready.version, error=str(exc))
            return
        fields = {k: round(v, 4) if isinstance(v, float) else v for k, v in timings.items()}
        fields.update(version=ready.version, mode=ready.mode, running=running,
                      total_s=round(time.perf_counter() - t0, 3))
        self.log.info("rollout.weights_updated", **fields)

    def on_signal(self, env: Any) -> None:
        msg = env.msg
        if isinstance(msg, WeightsReady):
            self.load(msg)
        elif isinstance(msg, Control) and msg.target_role in ("", "rollout"):
            if msg.action == "pause":
                self.paused = True
            elif msg.action == "resume":
                self.paused = False
            self.log.info("rollout.control", action=msg.action)

    # ------------------------------------------------------------ jobs
    def on_job(self, job: Any) -> None:
        msg = job.msg
        if not isinstance(msg, GenerateRequest):
            self.rt.fail(job, "bad_request", f"a rollout worker takes generate_request, got {msg.kind.value}")
            return
        if msg.min_version > self.engine.version:
            self.held.append(job)
            return
        self._submit(job)

    def _submit(self, job: Any) -> None:
        from areal_mq.engines.base import EngineRequest, SamplingParams

        msg = job.msg
        sampling = SamplingParams(**msg.sampling.model_dump())
        try:
            self.engine.submit(EngineRequest(job.id, [int(t) for t in msg.prompt_ids], sampling))
        except EngineRequestError as exc:
            self.rt.fail(job, "bad_request", str(exc))
            return
        self.jobs[job.id] = job
        self.log.debug("rollout.request_started", job=job.id, prompt_len=len(msg.prompt_ids),
                       version=self.engine.version)

    def release_held(self) -> None:
        if not self.held:
            return
        ready = [j for j in self.held if j.msg.min_version <= self.engine.version]
        self.held = [j for j in self.held if j.msg.min_version > self.engine.version]
        for job in ready:
            self._submit(job)

    def step(self) -> None:
        for out in self.engine.step():
            job = self.jobs.pop(out.request_id, None)
            if job is None:
                continue
            self.tokens += len(out.output_ids)
            self.rt.reply(job, GenerateResult(
                output_ids=out.output_ids, logprobs=out.logprobs, versions=out.versions,
                finish_reason=out.finish_reason, text=out.text, worker_id=self.rt.worker_id,
                group_id=job.msg.group_id, sample_index=job.msg.sample_index, stats=out.stats))
            self.log.debug("rollout.request_finished", job=job.id, tokens=len(out.output_ids),
                           reason=out.finish_reason, versions=sorted({int(v) for v in out.versions}))

    def maybe_report(self, every_s: float = 5.0) -> None:
        now = time.monotonic()
        if now - self._last_stats >= every_s:
            stats = self.engine.stats()
            fields = {k: v for k, v in stats.items() if isinstance(v, (int, float))}
            fields.update(running=len(self.jobs), held=len(self.held), tokens=self.tokens,
                          occupancy=round(len(self.jobs) / max(1, self.rt.capacity), 3))
            self.log.info("rollout.stats", **fields)
            self._last_stats = now

    # ------------------------------------------------------------ loop
    def run(self) -> None:
        while not self.rt.stopping:
            self._one_round(accept=True)
        self.rt.ready(0)  # drain: nothing new, finish what runs
        deadline = time.monotonic() + self.cfg.rollout.drain_timeout_s
        while self.jobs and time.monotonic() < deadline:
            self._one_round(accept=False)
        for rid in list(self.jobs):  # left over: abort here, the broker requeues them on DISCONNECT
            self.engine.abort(rid)
        self.log.info("rollout.drained", handed_back=len(self.jobs) + len(self.held))

    def _one_round(self, accept: bool) -> None:
        while (env := self.rt.next_signal()) is not None:
            self.on_signal(env)
        self.release_held()
        busy = self.engine.has_work() and not self.paused
        if accept:
            job = self.rt.next_job(timeout=0.0 if busy else 0.05)
            while job is not None:
                self.on_job(job)
                job = self.rt.next_job()
        if busy:
            self.step()
        elif not accept:
            time.sleep(0.01)
        self.maybe_report()


def main(cfg: Any, worker_id: str | None = None) -> int:
    from areal_mq.engines import build_engine
    from areal_mq.threads import apply_thread_budget
    from areal_mq.workers.runtime import WorkerRuntime

    apply_thread_budget(cfg, "rollout")
    rt = WorkerRuntime(cfg, role="rollout", service="generate", capacity=cfg.rollout.max_concurrent,
                       worker_id=worker_id)
    engine = None
    try:
        t0 = time.perf_counter()
        engine = build_engine(cfg.rollout, cfg.model, seed=cfg.run.seed)
        rt.log.info("rollout.engine_ready", engine=cfg.rollout.engine, model=cfg.model.name,
                    load_s=round(time.perf_counter() - t0, 2))
        worker = RolloutWorker(cfg, engine, rt)
        initial = rt.start()
        if initial is not None:
            worker.load(initial)
        rt.ready()
        worker.run()
        return 0
    except ArealError as exc:
        rt.log.error("rollout.failed", error=str(exc))
        return 1
    finally:
        rt.close(drain_timeout=0.0)
        if engine is not None:
            engine.close()
