"""BackgroundPublisher (areal_mq/weights/background.py): versions are published in order in a thread of their
own, a third submit waits for room (at most one version waiting), a failure in the thread is raised in the
caller's thread by the next submit or flush, and close publishes what is queued."""
from __future__ import annotations

import threading
import time

import pytest

from areal_mq.weights.background import BackgroundPublisher


def test_versions_are_published_in_order_off_the_callers_thread():
    seen, threads = [], set()

    def publish(version, tensors, cfg):
        threads.add(threading.get_ident())
        seen.append((version, tensors["w"], cfg))

    bg = BackgroundPublisher(publish)
    for v in range(1, 6):
        bg.submit(v, {"w": v * 10}, "{}")
    assert bg.flush(30)
    assert seen == [(v, v * 10, "{}") for v in range(1, 6)] and bg.published == 5
    assert threading.get_ident() not in threads
    bg.close()


def test_a_third_submit_waits_while_one_publishes_and_one_waits():
    gate, started = threading.Event(), threading.Event()

    def publish(version, tensors, cfg):
        started.set()
        gate.wait(30)

    bg = BackgroundPublisher(publish)
    assert bg.submit(1, {}, None) < 5  # taken by the thread at once
    assert started.wait(10)
    assert bg.submit(2, {}, None) < 5  # waits in the queue
    timer = threading.Timer(0.5, gate.set)
    timer.start()
    bg.submit(3, {}, None)  # room only once version 1 is done, which needs the gate
    assert gate.is_set()
    assert bg.flush(30) and bg.published == 3
    bg.close()


def test_a_failure_in_the_thread_is_raised_by_the_next_call():
    def publish(version, tensors, cfg):
        if version == 2:
            raise OSError("disk full")

    bg = BackgroundPublisher(publish)
    bg.submit(1, {}, None)
    bg.submit(2, {}, None)
    with pytest.raises(RuntimeError, match="disk full"):
        bg.flush(30)
    with pytest.raises(RuntimeError, match="disk full"):
        bg.submit(3, {}, None)
    with pytest.raises(RuntimeError, match="disk full"):
        bg.close()


def test_close_publishes_what_is_queued():
    seen = []

    def publish(version, tensors, cfg):
        time.sleep(0.05)
        seen.append(version)

    bg = BackgroundPublisher(publish)
    for v in (1, 2):
        bg.submit(v, {}, None)
    bg.close()
    assert seen == [1, 2]
    with pytest.raises(RuntimeError, match="closed"):
        bg.submit(3, {}, None)


class _Log:
    def __init__(self):
        self.lines = []

    def error(self, event, **kw):
        self.lines.append((event, kw))

    info = warning = error


def test_a_full_disk_is_retried_in_place_and_the_version_lands():
    import errno

    tries, log = [], _Log()

    def publish(version, tensors, cfg):
        tries.append(version)
        if len(tries) <= 2:
            raise OSError(errno.ENOSPC, "No space left on device", "/run/weights/.v1.tmp")

    bg = BackgroundPublisher(publish, log=log, first_delay_s=0.01)
    bg.submit(1, {}, None)
    bg.submit(2, {}, None)
    assert bg.flush(30)
    assert tries == [1, 1, 1, 2] and bg.published == 2 and bg.retries == 2
    failed = [kw for event, kw in log.lines if event == "trainer.publish_failed"]
    assert len(failed) == 2 and failed[0]["errno"] == "ENOSPC" and failed[0]["version"] == 1
    bg.close()


def _raised_without_retry(error: Exception, match: str) -> None:
    """A publish failing with `error` (not a full disk) is raised from flush() at once, never retried."""
    def publish(version, tensors, cfg):
        raise error

    bg = BackgroundPublisher(publish, first_delay_s=0.01)
    bg.submit(1, {}, None)
    with pytest.raises(RuntimeError, match=match):
        bg.flush(30)
    assert bg.retries == 0


def test_a_disk_that_stays_full_past_the_retry_budget_is_raised_and_other_os_errors_at_once():
    import errno

    def full(version, tensors, cfg):
        raise OSError(errno.ENOSPC, "No space left on device")

    bg = BackgroundPublisher(full, first_delay_s=0.01, retry_s=0.2)
    bg.submit(1, {}, None)
    with pytest.raises(RuntimeError, match="No space left"):
        bg.flush(30)
    assert bg.retries >= 2

    _raised_without_retry(PermissionError(errno.EACCES, "Permission denied"), "Permission denied")


def test_safetensors_own_full_disk_error_is_retried_too_and_other_library_errors_are_not():
    from safetensors import SafetensorError

    tries = []

    def publish(version, tensors, cfg):  # what the 60-minute soak saw end the trainer 9 times
        tries.append(version)
        if len(tries) == 1:
            raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    bg = BackgroundPublisher(publish, log=_Log(), first_delay_s=0.01)
    bg.submit(1, {}, None)
    assert bg.flush(30) and tries == [1, 1] and bg.retries == 1
    bg.close()

    _raised_without_retry(SafetensorError("Error while serializing: invalid header"), "invalid header")


def test_close_returns_after_the_thread_died_with_a_version_still_queued():
    """The 60-minute soak's idle trainer: the thread failed on v1 while v2 sat in the queue (size 1), and close()'s
    blocking put(None) on that full queue never returned, so the failing trainer never exited."""
    import threading

    release = threading.Event()

    def publish(version, tensors, cfg):
        release.wait(10)
        raise ValueError("not a full disk")

    bg = BackgroundPublisher(publish, first_delay_s=0.01)
    bg.submit(1, {}, None)  # the thread takes it and waits
    bg.submit(2, {}, None)  # queued: the queue is full
    release.set()
    with pytest.raises(RuntimeError, match="not a full disk"):
        bg.flush(30)
    def close():
        with pytest.raises(RuntimeError):  # close() flushes first, and says why the thread ended
            bg.close()

    closer = threading.Thread(target=close, daemon=True)
    closer.start()
    closer.join(20)
    assert not closer.is_alive()


def test_one_definition_of_a_full_disk_for_every_writer():
    """areal_mq.errors.full_disk_errno is what the publisher and the sample store both ask (issue 52 item 6): an
    OSError by errno, a library's own error by the OS error in its text; anything else is not a full disk."""
    import errno

    from areal_mq.errors import full_disk_errno

    assert full_disk_errno(OSError(errno.ENOSPC, "No space left on device")) == errno.ENOSPC
    assert full_disk_errno(OSError(errno.EFBIG, "File too large")) == errno.EFBIG
    assert full_disk_errno(OSError(errno.EIO, "I/O error")) is None
    assert full_disk_errno(RuntimeError("I/O error: Disk quota exceeded (os error 122)")) == errno.EDQUOT
    assert full_disk_errno(RuntimeError("shape mismatch")) is None
