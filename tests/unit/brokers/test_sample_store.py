"""Sample store logic in-process (a real ROUTER on inproc): staleness bound, leases, durable replay."""
from __future__ import annotations

import threading

import numpy as np
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
        served, reported = [], 0
        while True:
            batch = client.get_batch(n, version=version, max_staleness=eta, wait_s=0)
            reported += batch.dropped_stale
            if not batch.samples:
                break
            served.extend(batch.samples)
            client.ack(batch)
        assert all(s.oldest_version() >= version - eta for s in served)
        fresh = sum(1 for v in oldest if v >= version - eta)
        assert len(served) == fresh - fresh % n  # every fresh sample is served (in whole batches)
        assert run.store.counters["dropped_stale"] == len(oldest) - fresh
        # every drop reaches the trainer once, in a served batch (none when no batch could be served)
        assert reported == (len(oldest) - fresh if served else 0)
        assert run.store.unreported_stale == (0 if served else len(oldest) - fresh)
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


# ---------------------------------------------------------------- η at the bound, per kind of sample (issue 27)
V, ETA = 5, 2  # the trainer asks at version 5 with η = 2: the floor is 3


def _single(sid, oldest):
    """A group of single answers (controller.scored_answers): every output token generated."""
    return _sample(sid, oldest, length=3).model_copy(update={"sample_id": sid})


def _multi_turn(sid, oldest):
    """A multi-turn episode (workflows/episode.py): turns across weight updates, environment tokens (-1) between."""
    from areal_mq.workflows.episode import Episode

    ep = Episode([1, 2])
    ep.add_generated([5, 6], [-0.5, -0.6], [oldest, oldest])  # the oldest turn
    ep.add_env([9, 9, 9])
    ep.add_generated([7, 8], [-0.1, -0.2], [oldest + 1, V])
    return Sample(sample_id=sid, seqs=[ep.to_seq(1.0), ep.to_seq(0.0)])


def _openai(sid, oldest):
    """An episode recorded through the OpenAI endpoint (openai/episodes.py): its segments -> one SeqSample."""
    from areal_mq.openai.episodes import Choice, EpisodeRecorder, RecordedTurn

    arr = lambda xs, t: np.asarray(xs, dtype=t)  # noqa: E731
    rec = EpisodeRecorder()
    rec.record("e", RecordedTurn(arr([1, 2], np.int32), [Choice(arr([5, 6], np.int32), arr([-0.5, -0.4], np.float32),
                                                        arr([oldest, oldest + 1], np.int32), "stop")]))
    rec.record("e", RecordedTurn(arr([1, 2, 5, 6, 9], np.int32), [Choice(arr([7], np.int32), arr([-0.3], np.float32),
                                                                  arr([V], np.int32), "stop")]))
    prompt, *rest = rec.pop("e").to_segments()
    seq = SeqSample(prompt_ids=prompt["tokens"], output_ids=[t for s in rest for t in s["tokens"]],
                    logprobs=[x for s in rest for x in s["logprobs"]], versions=[v for s in rest for v in s["versions"]],
                    loss_mask=[m for s in rest for m in s["loss_mask"]], reward=1.0)
    assert -1 in seq.versions.tolist()  # the environment's tokens between the turns
    return Sample(sample_id=sid, seqs=[seq])


@pytest.mark.parametrize("make", [_single, _multi_turn, _openai], ids=["single", "multi_turn", "openai_episode"])
def test_a_sample_exactly_at_the_bound_is_kept_one_version_older_is_dropped_and_counted(ctx, tmp_path, make):
    log = RecordingLog()
    run = Running(ctx, f"inproc://bound-{make.__name__}", tmp_path, log=log)
    client = StoreClient(f"inproc://bound-{make.__name__}", ctx=ctx)
    try:
        at, past = make("at", V - ETA), make("past", V - ETA - 1)
        assert (at.oldest_version(), past.oldest_version()) == (3, 2)
        client.put(past)
        client.put(at)
        batch = client.get_batch(2, version=V, max_staleness=ETA, wait_s=0)
        assert batch.samples == []  # only one sample is left: no batch of 2
        batch = client.get_batch(1, version=V, max_staleness=ETA, wait_s=0)
        assert [s.sample_id for s in batch.samples] == ["at"]
        assert batch.dropped_stale == 1  # the drop of the empty reply above is reported here, once
        assert run.store.counters["dropped_stale"] == 1
        assert [f["sample"] for f in log.named("store.sample_dropped")] == ["past"]
        client.ack(batch)
        client.put(make("next", V))
        assert client.get_batch(1, version=V, max_staleness=ETA, wait_s=0).dropped_stale == 0
    finally:
        client.close()
        run.stop()
