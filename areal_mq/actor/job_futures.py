"""Job id -> future for one JobClient: the one adapter between the job broker's answers and the code that waits.

What: `JobFutures(client).submit(msg, service, deadline)` submits a job and returns its id and a
`concurrent.futures.Future`; `pump()` resolves futures with their answers (the result message, or the broker's
`Error` as a value: what an Error means is the caller's business). A future that is cancelled, or whose deadline
passes unanswered, is forgotten (`JobClient.forget`: no more resubmissions, a late answer is dropped) and, if
nobody cancelled it, fails with TimeoutError. `AsyncJobFutures` is the same on an asyncio loop: a pump task
polls the client and `await call(msg, service)` returns one job's answer (the concurrent future wrapped with
`asyncio.wrap_future`, so a cancelled call cancels, and forgets, its job).
Why one adapter: the agent role (workers/agent.py, `AgentBackend`, asyncio) and the OpenAI endpoint
(areal_mq/openai/backend.py, `OpenAIBackend`, an owner thread that HTTP handler threads hand work to) both map
job ids to futures; resolving each once and forgetting what nobody waits for is written here once.
Threading: a JobClient's socket belongs to one thread, so the JobFutures methods are called from the thread that
owns the client (the OpenAI backend's owner thread, the agent's event-loop thread). The futures themselves are
thread-safe: any thread may wait on one or cancel it.
Tests: pytest tests/unit/test_job_futures.py -q
"""
from __future__ import annotations

import asyncio
import math
import time
from concurrent.futures import Future
from typing import Any, Callable

from areal_mq.messages import Kind, Message


class JobFutures:
    """Futures for the jobs of one JobClient (anything with submit / poll / forget); owner thread only."""

    def __init__(self, client: Any):
        self.client = client
        self._jobs: dict[str, tuple[Future, float]] = {}  # job id -> (future, deadline in time.monotonic())
        self._partials: dict[str, Callable[[Message], None]] = {}  # streamed job id -> called with each partial

    def __len__(self) -> int:
        return len(self._jobs)

    def submit(self, msg: Message, service: str, deadline: float = math.inf, future: Future | None = None,
               on_partial: Callable[[Message], None] | None = None) -> tuple[str, Future]:
        """Submit `msg` to `service`: (job id, the future its answer resolves). `deadline` is a time.monotonic()
        instant (default: none); `future` is one another thread made and waits on (default: a new one). A
        future cancelled meanwhile is fine: the next pump() forgets its job. `on_partial` gets each
        GeneratePartial of a streamed request (on the owner thread; it must not block) until the answer."""
        job_id = self.client.submit(msg, service=service)
        fut = future if future is not None else Future()
        self._jobs[job_id] = (fut, deadline)
        if on_partial is not None:
            self._partials[job_id] = on_partial
        return job_id, fut

    def pump(self, timeout: float = 0.0) -> int:
        """Forget the jobs nobody waits for, then resolve the answers that arrive within `timeout` seconds;
        returns how many arrived. Expiring first means a cancelled job is never resubmitted by this poll."""
        self.expire()
        answers = self.client.poll(timeout)
        for job_id, msg in answers:
            if msg.kind == Kind.GENERATE_PARTIAL:  # a view of a job still running: never resolves it
                if job_id in self._jobs and job_id in self._partials:
                    self._partials[job_id](msg)
                continue
            self._partials.pop(job_id, None)
            entry = self._jobs.pop(job_id, None)
            if entry is not None and entry[0].set_running_or_notify_cancel():
                entry[0].set_result(msg)
        return len(answers)

    def expire(self, now: float | None = None) -> list[str]:
        """Forget the jobs whose future was cancelled or whose deadline passed (those fail with TimeoutError);
        returns their ids."""
        now = time.monotonic() if now is None else now
        gone = [job_id for job_id, (fut, deadline) in self._jobs.items() if fut.cancelled() or now > deadline]
        for job_id in gone:
            fut = self.forget(job_id)
            if fut is not None and fut.set_running_or_notify_cancel():
                fut.set_exception(TimeoutError(f"job {job_id} was not answered by its deadline"))
        return gone

    def forget(self, job_id: str) -> Future | None:
        """Stop tracking `job_id` and tell the client to forget it; returns its future (None when unknown).
        The future is left as it is: the caller resolves or cancels it."""
        entry = self._jobs.pop(job_id, None)
        self._partials.pop(job_id, None)
        self.client.forget(job_id)
        return entry[0] if entry is not None else None

    def fail_all(self, exc: BaseException) -> int:
        """Fail every waiting future with `exc` and forget its job (the owner is stopping); returns how many."""
        failed = 0
        for job_id in list(self._jobs):
            fut = self.forget(job_id)
            if fut is not None and fut.set_running_or_notify_cancel():
                fut.set_exception(exc)
                failed += 1
        return failed


class AsyncJobFutures:
    """JobFutures on an asyncio loop: `start()` makes the client on the loop's thread (its owner from then on)
    and a pump task that polls it; `call()` awaits one job's answer. Use every method from that loop."""

    def __init__(self, make_client: Callable[[], Any], poll_s: float = 0.005):
        self.make_client, self.poll_s = make_client, poll_s
        self.jobs: JobFutures | None = None
        self._pump: asyncio.Task | None = None

    async def start(self) -> None:
        self.jobs = JobFutures(self.make_client())
        self._pump = asyncio.create_task(self._run())

    async def _run(self) -> None:
        while True:
            answered = self.jobs.pump(0.0)
            await asyncio.sleep(0 if answered else self.poll_s)

    async def call(self, msg: Message, service: str) -> Message:
        """Submit `msg` to `service` and wait for its answer (a result message or an Error)."""
        if self.jobs is None:
            raise RuntimeError("AsyncJobFutures.call before start(): start() makes the JobClient")
        job_id, fut = self.jobs.submit(msg, service)
        try:
            return await asyncio.wrap_future(fut)
        finally:  # a cancelled call (an episode's timeout): forget the job, the client must not resubmit it
            self.jobs.forget(job_id)

    async def close(self) -> None:
        """Stop the pump and close the client; calls still waiting are left to the loop's shutdown."""
        if self._pump is not None:
            self._pump.cancel()
        if self.jobs is not None:
            self.jobs.client.close()
