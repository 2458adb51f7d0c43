"""StickySessions, the job broker's session map and parked jobs: bounds, LRU order, expiry, dropped workers."""
from __future__ import annotations

from areal_mq.brokers.sticky import StickySessions


def test_the_session_map_is_lru_bounded_and_keeps_its_per_worker_index_in_step():
    s = StickySessions(max_sessions=3, wait_s=1.0)
    for i in range(3):
        s.remember(f"s{i}", b"A")
    assert s.home("s0") == b"A"  # refreshed: s1 is now the least recently used
    s.remember("s3", b"B")
    assert s.home("s1") is None and list(s.routes) == ["s2", "s0", "s3"]
    assert s.by_worker == {b"A": {"s0", "s2"}, b"B": {"s3"}}
    for i in range(1000):  # a client inventing sessions costs nothing beyond the bound
        s.remember(f"x{i}", b"C")
    assert len(s.routes) == 3 and sum(map(len, s.by_worker.values())) == 3


def test_a_session_moving_to_another_worker_leaves_the_old_ones_index():
    s = StickySessions(max_sessions=10, wait_s=1.0)
    s.remember("s", b"A")
    s.remember("s", b"B")
    assert s.by_worker[b"A"] == set() and s.by_worker[b"B"] == {"s"} and s.home("s") == b"B"


def test_parking_is_bounded_by_capacity_and_wait_and_served_oldest_first():
    s = StickySessions(max_sessions=10, wait_s=1.0)
    assert s.park("j1", b"A", capacity=2, now=0.0) and s.park("j2", b"A", capacity=2, now=0.1)
    assert not s.park("j3", b"A", capacity=2, now=0.2)  # as many waiting as it can free soon
    assert not s.park("j4", b"B", capacity=0, now=0.2)  # a draining worker frees nothing
    assert not StickySessions(10, wait_s=0.0).park("j5", b"A", capacity=2, now=0.0)  # 0: never wait
    assert s.next_parked(b"A") == "j1" and s.parked_count() == 1
    assert not s.due(0.9) and s.due(1.0)
    assert s.expired(1.05) == []  # j1 was served; j2's wait runs until 1.1
    assert s.expired(1.1) == ["j2"] and s.parked_count() == 0 and not s.due(5.0)


def test_a_dropped_worker_is_forgotten_and_its_parked_jobs_handed_back():
    s = StickySessions(max_sessions=10, wait_s=1.0)
    s.remember("s1", b"A")
    s.remember("s2", b"B")
    s.park("j1", b"A", capacity=1, now=0.0)
    assert s.forget_worker(b"A") == ["j1"]
    assert s.home("s1") is None and s.home("s2") == b"B" and s.expired(9.0) == []
    assert s.forget_worker(b"never-seen") == []


def test_release_hands_back_parked_jobs_but_keeps_sessions():
    s = StickySessions(max_sessions=10, wait_s=1.0)
    s.remember("s1", b"A")
    s.park("j1", b"A", capacity=2, now=0.0)
    s.park("j2", b"A", capacity=2, now=0.0)
    assert s.release(b"A") == ["j1", "j2"] and s.home("s1") == b"A" and s.expired(9.0) == []
