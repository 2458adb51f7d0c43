"""The OpenAI endpoint's link to the job broker: one thread owns the JobClient; HTTP threads wait on futures.

What: `OpenAIBackend.generate(prompt_ids, samplings, sessions, timeout_s)` submits one GenerateRequest per
sampling (service "generate") and returns their GenerateResults in order, or raises ApiError: 503 when the
broker has been silent past its liveness window (down, or our key refused), 504 when the answer missed the
deadline, 400 when a rollout worker refused the request (bad_request), 502/503 for other broker errors.
Why one thread: a ZeroMQ socket belongs to one thread, and JobClient's heartbeats and resubmission after a
broker restart must keep running while handler threads block. The owner thread keeps job id -> future in a
JobFutures (areal_mq/actor/job_futures.py, the adapter the agent role uses too).
A job past its deadline, or whose caller gave up, is forgotten (JobClient.forget: no resubmission); if its answer
arrives later it is ignored.
`OpenAIBackend.stream(prompt_ids, sampling, session, timeout_s)` submits one GenerateRequest with stream=True and
yields its GeneratePartials as the owner thread receives them (docs/protocol.md), then its GenerateResult, which
holds every token again (the partials are a view); errors raise ApiError as for `generate`.
"""
from __future__ import annotations

import queue
import threading
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, Callable, Iterator

import numpy as np

from areal_mq.actor.job_futures import JobFutures
from areal_mq.messages import Error, GeneratePartial, GenerateRequest, GenerateResult, SamplingSpec
from areal_mq.openai.api import ApiError

# broker Error code -> (HTTP status, OpenAI error code)
ERROR_STATUS = {"bad_request": (400, "invalid_request"), "queue_full": (503, "overloaded"),
                "no_service": (503, "no_rollout_workers"), "forbidden": (503, "broker_refused_key")}


class OpenAIBackend:
    """The endpoint's job broker link: HTTP handler threads call `generate`; one owner thread runs the client."""

    def __init__(self, client_factory: Callable[[], Any], silent_after_s: float, poll_s: float = 0.02,
                 log: Any = None):
        self._factory, self.silent_after_s, self.poll_s, self.log = client_factory, silent_after_s, poll_s, log
        self._inbox: queue.Queue = queue.Queue()
        self._jobs: JobFutures | None = None  # owner thread only
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="openai-broker", daemon=True)
        self._silent_s = 0.0  # written by the owner thread, read by handler threads
        self._down = False
        self._client: Any = None

    def start(self) -> None:
        self._client = self._factory()
        self._jobs = JobFutures(self._client)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(5.0)
        if self._client is not None:
            self._client.close()

    def broker_silent(self) -> bool:
        return self._down

    def generate(self, prompt_ids: list[int], samplings: list[SamplingSpec], sessions: list[str],
                 timeout_s: float) -> list[GenerateResult]:
        if self.broker_silent():
            raise self._unavailable()
        deadline = time.monotonic() + timeout_s
        futures = []
        for spec, session in zip(samplings, sessions):
            fut: Future = Future()
            msg = GenerateRequest(prompt_ids=np.asarray(prompt_ids, dtype=np.int32), sampling=spec,
                                  session=session, group_id="openai")
            self._inbox.put((msg, fut, deadline))
            futures.append(fut)
        try:
            return [self._result(f, deadline) for f in futures]
        finally:
            for f in futures:  # a choice failed: its siblings are not waited for either
                f.cancel()

    def stream(self, prompt_ids: list[int], sampling: SamplingSpec, session: str,
               timeout_s: float) -> Iterator[GeneratePartial | GenerateResult]:
        """One streamed choice, submitted now (a silent broker raises 503 here, before any answer is sent): an
        iterator of its partials as they arrive, then its result (the last item)."""
        if self.broker_silent():
            raise self._unavailable()
        deadline = time.monotonic() + timeout_s
        fut: Future = Future()
        parts: queue.SimpleQueue = queue.SimpleQueue()  # bounded by the answer: max_new_tokens tokens at most
        msg = GenerateRequest(prompt_ids=np.asarray(prompt_ids, dtype=np.int32), sampling=sampling, session=session,
                              group_id="openai", stream=True)
        self._inbox.put((msg, fut, deadline, parts.put))
        return _Events(self._events(fut, parts, deadline), fut)

    def _events(self, fut: Future, parts: queue.SimpleQueue,
                deadline: float) -> Iterator[GeneratePartial | GenerateResult]:
        try:
            while not fut.done():
                try:
                    yield parts.get(timeout=0.05)
                except queue.Empty:
                    if self.broker_silent() or time.monotonic() >= deadline:
                        break  # _result raises the 503 / 504
            while True:  # partials that came in just before the result
                try:
                    yield parts.get_nowait()
                except queue.Empty:
                    break
            yield self._result(fut, deadline)
        finally:
            fut.cancel()  # a client that went away mid-stream: the owner thread forgets the job

    def _result(self, fut: Future, deadline: float) -> GenerateResult:
        """Wait in slices: a broker that goes silent mid-call fails the call now (503), not at its deadline."""
        while True:
            try:
                msg = fut.result(timeout=min(0.25, max(0.0, deadline - time.monotonic())))
                break
            except (FutureTimeout, TimeoutError):
                if self.broker_silent():
                    fut.cancel()  # the owner thread forgets it: no resubmission once the broker is back
                    raise self._unavailable() from None
                if time.monotonic() >= deadline:
                    fut.cancel()
                    raise ApiError(504, "no rollout worker answered in time (all busy, or none running); try "
                                   "again", None, "timeout", "server_error") from None
        if isinstance(msg, Error):
            status, code = ERROR_STATUS.get(msg.code, (502, "broker_error"))
            raise ApiError(status, f"job broker: [{msg.code}] {msg.message[:500]}", None, code,
                           "invalid_request_error" if status == 400 else "server_error")
        if msg.finish_reason == "abort":
            raise ApiError(503, "the generation was aborted (a rollout worker stopped); try again", None,
                           "aborted", "server_error")
        return msg

    def _unavailable(self) -> ApiError:
        return ApiError(503, f"the job broker at {getattr(self._client, 'address', '?')} is not answering "
                        f"(no answer to heartbeats for over {self.silent_after_s:g}s): is it running, and is this "
                        "server's agent key in its key directory?", None, "broker_unavailable", "server_error")

    def _run(self) -> None:
        client = self._client
        while not self._stop.is_set():
            try:
                self._step(client)
            except Exception as exc:  # noqa: BLE001 - keep serving; the waiting calls time out
                if self.log:
                    self.log.exception("openai.backend_error", error=repr(exc)[:300])
                time.sleep(self.poll_s)
        self._jobs.fail_all(ApiError(503, "the server is stopping", None, "shutting_down", "server_error"))

    def _step(self, client: Any) -> None:
        while True:
            try:
                msg, fut, deadline, *on_partial = self._inbox.get_nowait()
            except queue.Empty:
                break
            if not fut.cancelled():  # a caller already gone (a sibling choice failed): never submitted
                self._jobs.submit(msg, "generate", deadline, fut, *on_partial)
        # past their deadline or cancelled: forgotten (no more resubmissions of a call nobody waits for)
        self._jobs.pump(self.poll_s)
        # silent past the liveness window, or reconnected and not heard since (a reconnect restarts the clock)
        self._silent_s = client.link.silent_s(time.monotonic())
        self._down = client.link.delay > 0 or self._silent_s > self.silent_after_s


class _Events:
    """A streamed call's events; close() cancels its job even before the first event was asked for (closing a
    generator that never started runs none of its code)."""

    def __init__(self, events: Iterator[GeneratePartial | GenerateResult], fut: Future):
        self._events, self._fut = events, fut

    def __iter__(self) -> "_Events":
        return self

    def __next__(self) -> GeneratePartial | GenerateResult:
        return next(self._events)

    def close(self) -> None:
        self._fut.cancel()  # the owner thread forgets the job
        self._events.close()
