"""The store's log under damage, and the store's memory bounds.

- a damaged record in the middle costs that record only (checksum, resync on the next record's magic), with
  an error event naming its offset; only a torn tail is cut; a record the protocol cannot decode is skipped
  the same way instead of stopping the store; old-format logs (no checksums) are still read;
- held samples, parked waiters, wait times and remembered ids are bounded; the log is compacted atomically
  and replayed record by record; stats() reports the most recent drops.
"""
from __future__ import annotations

import time
import tracemalloc

import msgpack
import numpy as np
import pytest
import zmq

from areal_mq import protocol
from areal_mq.brokers.sample_store import SampleLog, SampleStore
from areal_mq.client import StoreClient
from areal_mq.errors import JobFailed
from areal_mq.messages import GetBatch, Sample, SeqSample
from areal_mq.testing import RecordingLog

from .test_sample_store import Running, _sample

PUT_HEAD = b"\x82\xa2op\xa3put"  # how every put record's payload begins, in either log format


@pytest.fixture
def ctx():
    c = zmq.Context()
    yield c
    c.destroy(linger=0)  # also closes a socket a failed store constructor left open


def _fill(ctx, store_dir, n, **kw):
    run = Running(ctx, "inproc://fill", store_dir, **kw)
    client = StoreClient("inproc://fill", ctx=ctx)
    try:
        for i in range(n):
            client.put(_sample(i, 0))
        return dict(run.store.counters)
    finally:
        client.close()
        run.stop()


def _pending_ids(store):
    return list(store.pending)


def test_a_damaged_record_in_the_middle_costs_only_that_record(ctx, tmp_path):
    _fill(ctx, tmp_path, 20)
    path = tmp_path / "samples.log"
    data = bytearray(path.read_bytes())
    at = -1
    for _ in range(10):  # the 10th put record
        at = data.index(PUT_HEAD, at + 1)
    data[at] = 0xC1  # never valid msgpack
    path.write_bytes(bytes(data))
    events = RecordingLog()
    store = SampleStore(ctx, "inproc://d1", tmp_path, lease_s=60, max_frame_bytes=1 << 26, log=events)
    try:
        assert _pending_ids(store) == [f"s{i}" for i in range(20) if i != 9]  # 19 survive, not 9
        bad = events.named("store.log_record_bad")
        assert len(bad) == 1 and bad[0]["offset"] < at < bad[0]["offset"] + bad[0]["bytes"]
        assert (tmp_path / "bad-records").is_dir()  # the damaged bytes are kept, not destroyed
    finally:
        store.close()
    store = SampleStore(ctx, "inproc://d2", tmp_path, lease_s=60, max_frame_bytes=1 << 26, log=RecordingLog())
    try:  # and stay readable after the rewrite
        assert len(store.pending) == 19
    finally:
        store.close()


def test_a_record_the_protocol_cannot_decode_is_skipped_not_fatal(ctx, tmp_path):
    _fill(ctx, tmp_path, 3)
    frames = protocol.encode(_sample(7, 0))
    header = msgpack.unpackb(bytes(frames[0]), raw=False)
    header["v"] = 2
    log = SampleLog(tmp_path / "samples.log")
    log.append({"op": "put", "frames": [msgpack.packb(header), *[bytes(f) for f in frames[1:]]]})
    log.append({"op": "ack", "ids": ["s0"]})  # a record after the bad one still counts
    log.close()
    events = RecordingLog()
    store = SampleStore(ctx, "inproc://p1", tmp_path, lease_s=60, max_frame_bytes=1 << 26, log=events)
    try:
        assert _pending_ids(store) == ["s1", "s2"] and "s0" in store.done
        assert len(events.named("store.log_record_bad")) == 1
    finally:
        store.close()
    events = RecordingLog()  # a lowered frame limit: the store starts, the too-large records are reported
    store = SampleStore(ctx, "inproc://p2", tmp_path, lease_s=60, max_frame_bytes=4, log=events)
    try:
        assert _pending_ids(store) == [] and len(events.named("store.log_record_bad")) == 2
    finally:
        store.close()


def test_torn_tail_is_cut_and_a_torn_write_before_good_records_is_skipped(ctx, tmp_path):
    _fill(ctx, tmp_path, 2)
    path = tmp_path / "samples.log"
    size = path.stat().st_size
    with open(path, "ab") as f:
        f.write(b"SLOG\x50\x00\x00\x00torn")
    events = RecordingLog()
    SampleStore(ctx, "inproc://t1", tmp_path, lease_s=60, max_frame_bytes=1 << 26, log=events).close()
    assert path.stat().st_size == size and len(events.named("store.log_tail_cut")) == 1
    assert not events.named("store.log_record_bad")


def test_old_logs_without_checksums_are_still_read(ctx, tmp_path):
    path = tmp_path / "samples.log"
    with open(path, "wb") as f:
        for rec in ({"op": "put", "frames": [bytes(x) for x in protocol.encode(_sample(0, 0))]},
                    {"op": "put", "frames": [bytes(x) for x in protocol.encode(_sample(1, 0))]},
                    {"op": "ack", "ids": ["s0"]}):
            blob = msgpack.packb(rec, use_bin_type=True)
            f.write(len(blob).to_bytes(4, "little") + blob)
    store = SampleStore(ctx, "inproc://v1", tmp_path, lease_s=60, max_frame_bytes=1 << 26, log=RecordingLog())
    try:
        assert _pending_ids(store) == ["s1"] and "s0" in store.done
    finally:
        store.close()
    assert path.read_bytes().startswith(b"AMQ-SLOG v2\n") and (tmp_path / "samples.log.v1").is_file()


# ------------------------------------------------------------------ bounded memory
def test_a_full_store_refuses_puts_until_the_trainer_takes_some(ctx, tmp_path):
    run = Running(ctx, "inproc://full", tmp_path, max_samples=3)
    client = StoreClient("inproc://full", ctx=ctx)
    try:
        for i in range(3):
            client.put(_sample(i, 0))
        with pytest.raises(JobFailed, match="store_full"):
            client.put(_sample(3, 0))
        assert client.put(_sample(0, 0)).info["duplicate"] is True  # a resend is still acknowledged
        client.ack(client.get_batch(2, version=0))
        assert client.put(_sample(3, 0)).info["duplicate"] is False
    finally:
        client.close()
        run.stop()


def test_waits_and_waiters_are_bounded(ctx, tmp_path):
    store = SampleStore(ctx, "inproc://w", tmp_path, lease_s=60, max_frame_bytes=1 << 26, log=RecordingLog(),
                        max_waiters=2, max_wait_ms=100)
    try:
        for i in range(3):
            store._on_get(f"c{i}".encode(), f"r{i}", GetBatch(n_samples=1, version=0, timeout_ms=10 ** 9))
        assert [w.req_id for w in store.waiters] == ["r1", "r2"] and store.counters["waiters_evicted"] == 1
        assert all(w.deadline < time.monotonic() + 1 for w in store.waiters)  # 10^9 ms cut to 100 ms
        store.tick(time.monotonic() + 0.2)
        assert store.waiters == []
    finally:
        store.close()


def test_done_ids_are_bounded_and_the_log_is_compacted(ctx, tmp_path):
    run = Running(ctx, "inproc://c1", tmp_path, max_done_ids=50, compact_bytes=16 << 10)
    client = StoreClient("inproc://c1", ctx=ctx)
    try:
        for i in range(120):
            client.put(_sample(i, 0))
        for _ in range(11):
            client.ack(client.get_batch(10, version=0))
        assert client.put(_sample(0, 0 + 5)).info["duplicate"] is False  # forgotten: older than 50 done ids
        assert client.put(_sample(119, 0)).info["duplicate"] is True
        stats = client.stats()
        assert stats["done"] == 50 and stats["counters"]["compactions"] >= 1
        assert stats["log_bytes"] < 16 << 10
    finally:
        client.close()
        run.stop()
    assert not list(tmp_path.glob("*.tmp"))
    store = SampleStore(ctx, "inproc://c2", tmp_path, lease_s=60, max_frame_bytes=1 << 26, log=RecordingLog(),
                        max_done_ids=50)
    try:
        assert sorted(store.pending) == sorted(["s110", "s111", "s112", "s113", "s114", "s115", "s116", "s117",
                                                "s118", "s119", "s0"])
        assert "s109" in store.done and len(store.done) == 50
    finally:
        store.close()


def test_replay_streams_the_log_record_by_record(ctx, tmp_path):
    big = np.zeros(1 << 20, dtype=np.int32)  # 4 MiB per array, 12 MiB per sample
    log = SampleLog(tmp_path / "samples.log")
    for i in range(6):
        seq = SeqSample(prompt_ids=np.ones(1, np.int32), output_ids=big, logprobs=big.astype(np.float32),
                        versions=big, reward=0.0)
        log.append_put(protocol.encode(Sample(sample_id=f"b{i}", seqs=[seq])))
        log.append({"op": "ack", "ids": [f"b{i}"]})
    log.close()
    assert (tmp_path / "samples.log").stat().st_size > 70 << 20
    tracemalloc.start()
    try:
        store = SampleStore(ctx, "inproc://r", tmp_path, lease_s=60, max_frame_bytes=1 << 26, log=RecordingLog())
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    store.close()
    assert len(store.done) == 6 and peak < 40 << 20, peak  # one record at a time, not the whole 72 MiB file


def test_stats_name_the_recent_drops_and_they_survive_a_restart(ctx, tmp_path):
    run = Running(ctx, "inproc://dr", tmp_path)
    client = StoreClient("inproc://dr", ctx=ctx)
    try:
        client.put(_sample(1, 0))
        client.put(_sample(2, 5))
        client.get_batch(1, version=5, max_staleness=1, wait_s=0)
        assert client.stats()["dropped_recent"] == [["s1", "stale"]]
    finally:
        client.close()
        run.stop()
    store = SampleStore(ctx, "inproc://dr2", tmp_path, lease_s=60, max_frame_bytes=1 << 26, log=RecordingLog())
    try:
        assert store.stats()["dropped_recent"] == [["s1", "stale"]]
        store.compact()
    finally:
        store.close()
    store = SampleStore(ctx, "inproc://dr3", tmp_path, lease_s=60, max_frame_bytes=1 << 26, log=RecordingLog())
    try:
        assert store.stats()["dropped_recent"] == [["s1", "stale"]]
        assert list(store.pending) == [] and store.stats()["leased"] == 1  # s2 was served: its lease survives
    finally:
        store.close()


def test_oversized_frames_are_dropped_at_the_socket(ctx, tmp_path):
    run = Running(ctx, "tcp://127.0.0.1:0", tmp_path, max_frame_bytes=1 << 20)
    addr = run.store.sock.getsockopt(zmq.LAST_ENDPOINT).decode()
    assert run.store.sock.getsockopt(zmq.MAXMSGSIZE) == (1 << 20) + protocol.MAX_HEADER_BYTES
    raw = ctx.socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(addr)
    client = StoreClient(addr, ctx=ctx)
    try:
        frames = protocol.encode(_sample(0, 0))
        raw.send_multipart([frames[0], b"x" * (6 << 20)])
        assert raw.poll(1000) == 0  # no Error comes back: the connection is dropped
        assert client.put(_sample(1, 0)).info["duplicate"] is False  # everyone else is still served
        assert run.store.counters["put"] == 1
    finally:
        raw.close(0)
        client.close()
        run.stop()


def test_an_acked_batch_leaves_no_lease_behind_after_a_restart(ctx, tmp_path):
    run = Running(ctx, "inproc://al", tmp_path)
    client = StoreClient("inproc://al", ctx=ctx)
    try:
        client.put(_sample(0, 0))
        client.put(_sample(1, 0))
        client.ack(client.get_batch(2, version=0))
    finally:
        client.close()
        run.stop()
    store = SampleStore(ctx, "inproc://al2", tmp_path, lease_s=60, max_frame_bytes=1 << 26, log=RecordingLog())
    try:
        assert store.stats()["leased"] == 0 and store.leases == {}
    finally:
        store.close()


_FULL_DISK_SCRIPT = r"""
import resource, signal, sys
from pathlib import Path
from areal_mq.brokers.sample_log import SampleLog

signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit then fails with EFBIG, like a full disk
path = Path(sys.argv[1])
log = SampleLog(path)
log.append({"op": "ack", "ids": ["before"]})
soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
resource.setrlimit(resource.RLIMIT_FSIZE, (path.stat().st_size + 100, hard))
failed = 0
for i in range(3):  # each record is bigger than the room left: the kernel writes part of it, then refuses
    try:
        log.append({"op": "put", "frames": [b"x" * 500]})
    except OSError:
        failed += 1
resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))  # space comes back
log.append({"op": "ack", "ids": ["after"]})
log.close()
print(failed, path.stat().st_size, log.size)
"""


def test_a_write_that_fails_part_way_leaves_no_bytes_before_later_records(tmp_path):
    """Found by the 10-minute soak of 2026-11-28: a full disk cut three put records part-way, the store wrote
    good records after them once space came back, and the next replay quarantined the partial ones as a bad
    record mid-log. A failed write is now cut back, so the log holds only whole records."""
    import subprocess
    import sys

    path = tmp_path / "samples.log"
    out = subprocess.run([sys.executable, "-c", _FULL_DISK_SCRIPT, str(path)], capture_output=True, text=True,
                         timeout=60, check=True).stdout.split()
    failed, on_disk, counted = map(int, out)
    assert failed == 3 and on_disk == counted
    events = RecordingLog()
    log = SampleLog(path, log=events)
    records = [rec for _o, _n, rec in log.replay()]
    assert records == [{"op": "ack", "ids": ["before"]}, {"op": "ack", "ids": ["after"]}]
    assert log.bad_records == 0 and not events.named("store.log_tail_cut")
    assert not (tmp_path / "bad-records").exists()


def test_a_failed_write_the_file_cannot_cut_back_is_cut_before_the_next_one(tmp_path, monkeypatch):
    import errno
    import os

    from areal_mq.brokers import sample_log

    log = SampleLog(tmp_path / "samples.log")
    log.append({"op": "ack", "ids": ["a"]})
    good = log.size

    def half_then_full(fd, views):
        os.write(fd, bytes(views[0])[:5])
        raise OSError(errno.ENOSPC, "No space left on device")

    def cannot_cut(fd, length):
        raise OSError(errno.EIO, "Input/output error")

    with monkeypatch.context() as m:
        m.setattr(sample_log.os, "writev", half_then_full)
        m.setattr(sample_log.os, "ftruncate", cannot_cut)
        with pytest.raises(OSError, match="No space"):
            log.append({"op": "ack", "ids": ["lost"]})
    assert (tmp_path / "samples.log").stat().st_size == good + 5  # the partial bytes are still there ...
    log.append({"op": "ack", "ids": ["b"]})  # ... until the next write cuts them first
    log.close()
    assert [rec["ids"] for _o, _n, rec in SampleLog(tmp_path / "samples.log").replay()] == [["a"], ["b"]]
