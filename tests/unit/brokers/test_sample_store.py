"""Sample store logic in-process (a real ROUTER on inproc): staleness bound, leases, durable replay."""
from __future__ import annotations

import threading

import pytest
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st

from areal_mq.brokers.sample_store import SampleStore
from areal_mq.client import StoreClient
from areal_mq.messages import Sample, SeqSample
from areal_mq.testing import RecordingLog


class Running:
    """A SampleStore served by a thread; stop() joins it."""

    def __init__(self, ctx, addr, store_dir, lease_s=60.0, log=None, **kw):
        kw.setdefault("max_frame_bytes", 1 << 26)
        self.store = SampleStore(ctx, addr, store_dir, lease_s=lease_s, log=log or RecordingLog(), **kw)
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def _loop(self):
        import time

        while not self._stop.is_set():
            if self.store.sock.poll(20):
                self.store.handle()
            self.store.tick(time.monotonic())
        self.store.close()

    def stop(self):
        self._stop.set()
        self.thread.join(5)


def _sample(i, oldest, length=2):
    versions = [oldest] + [oldest + 1] * (length - 1)
    return Sample(sample_id=f"s{i}", seqs=[SeqSample(prompt_ids=[1], output_ids=[7] * length,
                                                      logprobs=[-1.0] * length, versions=versions, reward=0.0)])


@pytest.fixture
def ctx():
    c = zmq.Context()
    yield c
    c.term()


@given(oldest=st.lists(st.integers(0, 10), min_size=1, max_size=12), version=st.integers(0, 12),
       eta=st.integers(0, 4), n=st.integers(1, 4))
@settings(max_examples=25, deadline=None)
def test_no_sample_older_than_the_bound_is_served(tmp_path_factory, oldest, version, eta, n):
    ctx = zmq.Context()
    addr = f"inproc://store-{id(oldest)}-{version}"
    run = Running(ctx, addr, tmp_path_factory.mktemp("store"))
    client = StoreClient(addr, ctx=ctx)
    try:
        for i, v in enumerate(oldest):
            client.put(_sample(i, v))
        served = []
        while True:
            batch = client.get_batch(n, version=version, max_staleness=eta, wait_s=0)
            if not batch.samples:
                break
            served.extend(batch.samples)
            client.ack(batch)
        assert all(s.oldest_version() >= version - eta for s in served)
        fresh = sum(1 for v in oldest if v >= version - eta)
        assert len(served) == fresh - fresh % n  # every fresh sample is served (in whole batches)
        assert run.store.counters["dropped_stale"] == len(oldest) - fresh
    finally:
        client.close()
        run.stop()
        ctx.term()


def test_lease_release_and_replay_after_restart(ctx, tmp_path):
    run = Running(ctx, "inproc://s1", tmp_path)
    client = StoreClient("inproc://s1", ctx=ctx)
    for i in range(3):
        client.put(_sample(i, 0))
    leased = client.get_batch(2, version=0)
    again = client.get_batch(2, version=0, release_leases=True)  # a restarted trainer
    assert [s.sample_id for s in again.samples] == [s.sample_id for s in leased.samples]
    client.ack(again)
    client.close()
    run.stop()
    with open(tmp_path / "samples.log", "ab") as f:
        f.write(b"\x50\x00\x00\x00torn")  # a crash in the middle of a record
    run2 = Running(ctx, "inproc://s2", tmp_path)
    client = StoreClient("inproc://s2", ctx=ctx)
    try:
        left = client.get_batch(1, version=0, wait_s=0)
        assert [s.sample_id for s in left.samples] == ["s2"]
        assert client.put(_sample(0, 0)).info["duplicate"] is True
    finally:
        client.close()
        run2.stop()


def test_a_request_the_store_cannot_read_fails_at_once_not_at_its_deadline(ctx, tmp_path):
    """A GetBatch whose header passes the 4 MiB limit is answered Error(too_large) with no id (the store
    could not read one): the client takes it as the answer to its one outstanding call instead of waiting
    out the whole deadline (it used to wait the full timeout, then say the store did not answer)."""
    import time

    from areal_mq.errors import JobFailed

    run = Running(ctx, "inproc://store-too-large", tmp_path)
    client = StoreClient("inproc://store-too-large", ctx=ctx)
    try:
        t0 = time.monotonic()
        with pytest.raises(JobFailed, match="too_large"):
            client.get_batch(1, version=0, skip_ids=[f"{i:032d}" for i in range(200_000)], timeout=60)
        assert time.monotonic() - t0 < 20
        client.put(_sample(1, 0))  # the store and the client go on
        assert [s.sample_id for s in client.get_batch(1, version=0, wait_s=0).samples] == ["s1"]
    finally:
        client.close()
        run.stop()
