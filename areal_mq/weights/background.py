"""Publishing beside training: the trainer's step waits only for its snapshot, never for the publish.

What: `BackgroundPublisher(publish)` runs `publish(version, tensors, hf_config_json)` (encode, checksum, delta
against the previous version, write the disk directory or hand the chunks to the weight server, announce
WeightsReady on the bus) in one thread of its own, in version order. The trainer's publisher (publisher.py,
trainer.publish_async) calls `submit` with a snapshot (Trainer.publish_tensors or publish_slices: a copy in
trainer.publish_dtype, so the next optimizer step cannot change what is being published) and the trainer goes on
with its next step at once.
Bounds: at most one version waits while another is being published; a third `submit` blocks until the thread
takes the waiting one (backpressure, counted in the step's `publish_s`). So besides what the weight server keeps
(trainer.keep_weight_versions), at most 2 snapshots are alive: 2 x the model's bytes in publish_dtype.
Failures are not silent: an exception in the thread is raised again by the next `submit` or `flush` in the
trainer's own thread (the worker then stops and the launcher restarts it, as before). A full disk (ENOSPC, EDQUOT)
is the one failure retried in place: `trainer.publish_failed` (error, with the errno and the next try) and the same
version again after 1, 2, 4 … 30 s, for up to `retry_s` (600 s); training goes on meanwhile until the queue is full,
then the step waits. A restart would redo every version since the last checkpoint for the same full disk; the
disk publisher writes a version under a temporary name and renames it, so a failed try leaves nothing half-written.
Why a thread and not a process: the snapshot would have to be copied again to reach a process; the encoding's
heavy parts (torch copies, checksums, zlib, zmq sends) release the GIL.
Thread safety: the bus socket and the publisher are used by this thread only, once it started (the trainer's
thread stops touching them; zmq sockets may move between threads with the queue's memory barrier).
"""
from __future__ import annotations

import errno
import queue
import threading
import time
from typing import Any, Callable, Mapping

from areal_mq.errors import full_disk_errno


class BackgroundPublisher:
    """`submit(version, tensors, hf_config_json) -> seconds blocked`; `flush()`; `close()`."""

    def __init__(self, publish: Callable[[int, Mapping[str, Any], str | None], Any], log: Any = None,
                 retry_s: float = 600.0, first_delay_s: float = 1.0):
        self._publish = publish
        self._log = log
        self.retry_s, self.first_delay_s = retry_s, first_delay_s
        self.retries = 0  # tries that met a full disk and were repeated
        self._queue: queue.Queue = queue.Queue(maxsize=1)
        self._idle = threading.Condition()
        self._busy = 0  # submitted and not yet published
        self._error: BaseException | None = None
        self._closed = False
        self.published = 0
        self.last_publish_s = 0.0
        self._thread = threading.Thread(target=self._run, name="weight-publisher", daemon=True)
        self._thread.start()

    def submit(self, version: int, tensors: Mapping[str, Any], hf_config_json: str | None = None) -> float:
        """Queue `version` (a snapshot nobody changes afterwards). Returns the seconds this call waited for room."""
        self._raise()
        if self._closed:
            raise RuntimeError("BackgroundPublisher is closed")
        with self._idle:
            self._busy += 1
        t0 = time.perf_counter()
        while True:
            try:
                self._queue.put((version, tensors, hf_config_json), timeout=0.5)
                break
            except queue.Full:
                self._raise()  # the thread died with a version in hand: do not wait forever
        return time.perf_counter() - t0

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every submitted version is published (True) or `timeout` passes (False); raises the
        thread's error if it failed."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._idle:
            while self._busy and self._error is None:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._idle.wait(0.5 if left is None else min(left, 0.5))
        self._raise()
        return True

    def close(self, timeout: float = 120.0) -> None:
        """Publish what is queued (up to `timeout`), then stop the thread."""
        if self._closed:
            return
        try:
            self.flush(timeout)
        finally:
            self._closed = True
            # never a blocking put: a thread that died on an error leaves a queued version nobody takes, and a
            # put(None) on that full queue kept a failing trainer alive and idle for 15 minutes in the 60-minute soak
            if self._thread.is_alive():  # a dead thread reads nothing more; a live one takes what is queued, then None
                try:
                    self._queue.put(None, timeout=10.0)
                except queue.Full:
                    pass
            self._thread.join(timeout=10.0)

    def _raise(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"publishing weights failed in the background: {self._error!r}") from self._error

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            version, tensors, hf_config_json = item
            t0 = time.perf_counter()
            try:
                self._publish_retrying(version, tensors, hf_config_json)
            except BaseException as exc:  # noqa: BLE001 - handed to the trainer's thread, which raises it
                self._error = exc
                with self._idle:
                    self._busy = 0
                    self._idle.notify_all()
                return
            self.last_publish_s = time.perf_counter() - t0
            self.published += 1
            if self._log is not None:
                self._log.info("trainer.published", version=version, publish_s=round(self.last_publish_s, 4))
            with self._idle:
                self._busy -= 1
                self._idle.notify_all()

    def _publish_retrying(self, version: int, tensors: Mapping[str, Any], hf_config_json: str | None) -> None:
        """One publish; a full disk is retried with backoff until `retry_s` has passed (then raised as any error)."""
        started, delay = time.monotonic(), self.first_delay_s
        while True:
            try:
                self._publish(version, tensors, hf_config_json)
                return
            except Exception as exc:  # noqa: BLE001 - only a full disk is retried; the rest is raised as it was
                waited = time.monotonic() - started
                code = full_disk_errno(exc)
                if code is None or self._closed or waited + delay > self.retry_s:
                    raise
                self.retries += 1
                if self._log is not None:
                    self._log.error("trainer.publish_failed", version=version, errno=errno.errorcode.get(code),
                                    error=str(exc)[:300], retry_in_s=delay, waited_s=round(waited, 1),
                                    hint="the disk the weights are written to is full; this version is retried in "
                                         "place, training goes on until the publish queue is full")
                time.sleep(delay)
                delay = min(delay * 2, 30.0)
