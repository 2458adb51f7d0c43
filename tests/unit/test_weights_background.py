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
