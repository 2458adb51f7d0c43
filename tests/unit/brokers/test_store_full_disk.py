"""The sample store on a full disk (the soak's disk_full fault, 2026-11-28): a log write that fails changes no
state and leaves no bytes, the request is answered `disk_full`, a StoreClient sends it again until space returns
(or its deadline), and lease expiry waits for the next tick. Nothing is lost, served twice or left half-written."""
from __future__ import annotations

import errno
import os
import threading
import time

import pytest
import zmq

from areal_mq.brokers import sample_log
from areal_mq.brokers.sample_log import SampleLog
from areal_mq.client import StoreClient
from areal_mq.errors import JobFailed
from areal_mq.testing import RecordingLog

from .test_sample_store import Running, _sample


class FullDisk:
    """os.writev as on a disk that is full while `on` is set: a few bytes go down, then ENOSPC."""

    def __init__(self, monkeypatch):
        self.on = threading.Event()
        self.refused = 0
        real = os.writev

        def writev(fd, views):
            if self.on.is_set():
                self.refused += 1
                os.write(fd, bytes(views[0])[:7])
                raise OSError(errno.ENOSPC, "No space left on device")
            return real(fd, views)

        monkeypatch.setattr(sample_log.os, "writev", writev)


@pytest.fixture
def ctx():
    c = zmq.Context()
    yield c
    c.destroy(linger=0)


def _records(store_dir):
    return [rec for _o, _n, rec in SampleLog(store_dir / "samples.log").replay()]


def test_a_put_on_a_full_disk_is_retried_until_space_returns(ctx, tmp_path, monkeypatch):
    disk = FullDisk(monkeypatch)
    events = RecordingLog()
    run = Running(ctx, "inproc://full-put", tmp_path, log=events)
    client = StoreClient("inproc://full-put", ctx=ctx)
    try:
        disk.on.set()
        threading.Timer(2.5, disk.on.clear).start()
        t0 = time.monotonic()
        ack = client.put(_sample(1, 0), timeout=30)
        assert ack.info == {"duplicate": False} and time.monotonic() - t0 >= 2.0
        assert disk.refused >= 2 and run.store.counters["disk_full"] == disk.refused
        assert events.named("store.disk_full") and not events.named("store.internal_error")
    finally:
        client.close()
        run.stop()
    records = _records(tmp_path)
    assert [r["op"] for r in records] == ["put"]  # once, whole: no partial record before it
    assert not (tmp_path / "bad-records").exists()


def test_a_put_still_refused_at_the_deadline_raises_naming_the_full_disk(ctx, tmp_path, monkeypatch):
    disk = FullDisk(monkeypatch)
    run = Running(ctx, "inproc://full-deadline", tmp_path)
    client = StoreClient("inproc://full-deadline", ctx=ctx)
    try:
        disk.on.set()
        with pytest.raises(JobFailed, match=r"until the deadline.*\[disk_full\].*no space"):
            client.put(_sample(1, 0), timeout=2.5)
        disk.on.clear()
        assert client.put(_sample(1, 0), timeout=10).info == {"duplicate": False}  # nothing half-recorded
    finally:
        client.close()
        run.stop()


def test_serving_and_lease_expiry_on_a_full_disk_lose_nothing(ctx, tmp_path, monkeypatch):
    disk = FullDisk(monkeypatch)
    run = Running(ctx, "inproc://full-get", tmp_path, lease_s=0.5)
    client = StoreClient("inproc://full-get", ctx=ctx)
    try:
        for i in range(4):
            client.put(_sample(i, 0), timeout=10)
        first = client.get_batch(2, version=0, wait_s=0.5)
        assert len(first.samples) == 2
        disk.on.set()  # the lease expires while the release cannot be written: it waits, it is not dropped
        threading.Timer(2.0, disk.on.clear).start()
        second = client.get_batch(2, version=0, wait_s=0.5, timeout=30)  # disk_full until space returns
        assert len(second.samples) == 2
        time.sleep(1.0)  # the first lease's release is written on a tick after space returned
        served = {s.sample_id for s in second.samples}
        stats = client.stats()
        assert stats["leased"] + stats["pending"] == 4 - 0  # every sample is held: leased again or pending
        third = client.get_batch(4, version=0, wait_s=2.0)  # the expired lease's samples came back
        assert {s.sample_id for s in third.samples} | served == {f"s{i}" for i in range(4)}
        assert run.store.counters["disk_full"] >= 1
    finally:
        client.close()
        run.stop()
    ops = [r["op"] for r in _records(tmp_path)]
    assert ops.count("put") == 4 and not (tmp_path / "bad-records").exists()


def test_a_compaction_that_meets_a_full_disk_keeps_the_old_log_and_leaves_no_copy(tmp_path, monkeypatch):
    disk = FullDisk(monkeypatch)
    log = SampleLog(tmp_path / "samples.log")
    log.append({"op": "ack", "ids": ["a"]})
    before = (tmp_path / "samples.log").read_bytes()

    def fill(new):
        new.append({"op": "done", "ids": ["a"]})

    disk.on.set()
    with pytest.raises(OSError, match="No space"):
        log.rewrite(fill)
    disk.on.clear()
    assert (tmp_path / "samples.log").read_bytes() == before and not list(tmp_path.glob("*.tmp"))
    log.append({"op": "ack", "ids": ["b"]})
    log.close()
    assert [r["ids"] for r in _records(tmp_path)] == [["a"], ["b"]]
