"""Weight deltas: the codec (every dtype bit-exact, the smaller encoding, hostile payloads refused within bounds),
the receiver's plans (cheapest first), and the catch-up over a real weight server and real files: a worker at
the base fetches only the delta, one that missed three versions applies the chain, a corrupt delta on the wire
or on disk makes it fetch full with the reason, a server that dies mid-transfer fails within its deadline and
leaves the held weights as they were.
Run: pytest tests/unit/test_weights_delta.py -q
"""
from __future__ import annotations

import time

import numpy as np
import pytest
import torch
import zstandard

from areal_mq.algorithms.config import TrainerConfig
from areal_mq.errors import WeightsFetchError
from areal_mq.messages import WeightsLink, WeightsReady
from areal_mq.weights import WeightPublisher, WeightServer
from areal_mq.weights.disk import DELTA_FILE, FULL_FILE, disk_versions, read_disk
from areal_mq.weights.catchup import WeightCatchup, plans
from areal_mq.weights.delta import DeltaError, TensorDelta, apply, apply_version, checksum, encode, encode_version


def _pair(dtype, n=4000, changed=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        a = torch.randn(n, generator=g).to(dtype)
    elif dtype == torch.bool:
        a = torch.randint(0, 2, (n,), generator=g).bool()
    else:
        a = torch.randint(-1000, 1000, (n,), generator=g).to(dtype)
    b = a.clone()
    idx = torch.randperm(n, generator=g)[:changed]
    b[idx] = ~b[idx] if dtype == torch.bool else b[idx] + 1
    return a.reshape(40, -1), b.reshape(40, -1)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.int64,
                                   torch.int32, torch.uint8, torch.bool])
def test_every_dtype_round_trips_bit_exactly(dtype):
    a, b = _pair(dtype)
    d = encode("w", a, b)
    out = apply(a, d)
    assert out.dtype == b.dtype and out.shape == b.shape and checksum(out) == checksum(b) == d.checksum
    assert torch.equal(out.view(torch.uint8) if dtype == torch.bool else out, b.view(torch.uint8)
                       if dtype == torch.bool else b)


def test_the_smaller_encoding_wins_and_bits_not_values_are_compared():
    a, b = _pair(torch.float32, changed=10)
    assert encode("w", a, b).encoding == "sparse"
    dense = a + 1.0
    d = encode("w", a, dense)
    assert d.encoding == "xor" and d.nbytes < a.numel() * 4
    nan = torch.tensor([float("nan"), 0.0, 1.0])
    flipped = torch.tensor([float("nan"), -0.0, 1.0])  # -0.0 == 0.0 as values, not as bits
    d = encode("z", nan, flipped)
    assert d.count == 1 and torch.equal(apply(nan, d).view(torch.int32), flipped.view(torch.int32))
    same = encode("s", a, a.clone())
    assert same.encoding == "sparse" and same.count == 0 and torch.equal(apply(a, same), a)


def _bad(d: TensorDelta, **kw) -> TensorDelta:
    return TensorDelta(**{**d.__dict__, **kw})


def test_hostile_or_broken_deltas_are_refused_with_a_reason():
    a, b = _pair(torch.bfloat16, changed=30)
    d = encode("w", a, b)
    assert d.encoding == "sparse"
    cases = {
        "base": [_bad(d, shape=[4000]), _bad(d, dtype="float16")],
        "corrupt": [
            _bad(d, encoding="lz4"),
            _bad(d, count=a.numel() + 1),
            _bad(d, count=d.count - 1),  # the frame holds more than declared
            _bad(d, payload=np.frombuffer(b"not zstd at all", np.uint8)),
            # a frame that declares far more than the tensor: refused before anything is allocated
            _bad(d, encoding="xor", count=0, payload=np.frombuffer(
                zstandard.ZstdCompressor().compress(bytes(1 << 20)), np.uint8)),
            # positions that go backwards
            _bad(d, count=2, payload=np.frombuffer(zstandard.ZstdCompressor().compress(
                np.array([5, 0], np.uint32).tobytes() + bytes(4)), np.uint8)),
        ],
        "checksum": [_bad(d, checksum="0" * 32)],
    }
    for reason, deltas in cases.items():
        for bad in deltas:
            with pytest.raises(DeltaError) as err:
                apply(a, bad)
            assert err.value.reason == reason, (reason, str(err.value))
    flipped = d.payload.copy()
    flipped[len(flipped) // 2] ^= 0xFF
    with pytest.raises(DeltaError):
        apply(a, _bad(d, payload=flipped))
    with pytest.raises(DeltaError, match="covers 1 tensors"):
        apply_version({"w": a, "v": a}, [d])
    with pytest.raises(ValueError, match="same dtype and shape"):
        encode("w", a, b.float())


def test_plans_are_cheapest_first():
    links = [WeightsLink(version=4, chunks=2, bytes=1000), WeightsLink(version=8, chunks=2, bytes=1000)]
    links += [WeightsLink(version=v, base=v - 1, chunks=1, bytes=100) for v in range(5, 9)]
    ready = WeightsReady(version=8, mode="zmq", endpoint="tcp://127.0.0.1:1", base=7, links=links)
    assert [(r, [(p.version, p.base) for p in ps]) for r, ps in plans(ready, 7)][:2] == [
        ("delta", [(8, 7)]), ("full", [(8, -1)])]
    assert plans(ready, 4)[0][0] == "chain" and len(plans(ready, 4)[0][1]) == 4
    assert plans(ready, 2)[0][0] == "full"  # no chain from v2: full v8 (1000) beats v4 + 4 deltas (1400)
    assert [r for r, _ in plans(ready, -1)] == ["full", "full+chain"]


def _state(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"embed": torch.randn(512, 32, generator=g), "w": torch.randn(32, 64, generator=g),
            "norm": torch.ones(32)}


def _step(state, seed):
    g = torch.Generator().manual_seed(1000 + seed)
    for t in state.values():
        t.add_(1e-3 * torch.randn(t.shape, generator=g))


def _published(state):
    return {k: v.to(torch.bfloat16) for k, v in state.items()}


def _same(got, want):
    assert list(got) == list(want) or sorted(got) == sorted(want)
    for k in want:
        assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), k


@pytest.fixture
def zmq_pub(tmp_path):
    pub = WeightPublisher(TrainerConfig(publish_mode="zmq", weight_chunk_mb=0.01, full_every=5), tmp_path)
    yield pub
    pub.close()


def test_zmq_delta_then_a_missed_stretch_then_too_far_behind(tmp_path, zmq_pub):
    state = _state()
    catchup = WeightCatchup(tmp_path, zmq_pub.cfg, timeout_s=20)
    routes = []
    for v in range(1, 15):
        _step(state, v)
        ready = zmq_pub.publish(v, state)
        if v in (5, 6, 7) or v in range(9, 14):  # missed three versions, then five (more than full_every deltas)
            continue
        update = catchup.prepare(ready)
        _same(update.hold, _published(state))
        catchup.commit(update)
        routes.append((v, update.route, update.fallback.split(":")[0]))
        if update.route == "delta":
            assert ready.base == v - 1 and update.fetched_bytes < update.full_bytes / 2
    assert routes == [(1, "full", ""), (2, "delta", ""), (3, "delta", ""), (4, "delta", ""),
                      (8, "chain", "base"), (14, "full", "base")]


def _corrupt_delta_frames(server: WeightServer, version: int) -> None:
    with server._lock:
        base, piece = server._delta[version]
        for frames in piece.frames:
            for i in range(1, len(frames)):  # array frames: flip a byte in the middle of each payload
                buf = bytearray(frames[i].tobytes() if hasattr(frames[i], "tobytes") else bytes(frames[i]))
                buf[len(buf) // 2] ^= 0x5A
                frames[i] = bytes(buf)


def test_a_corrupt_delta_on_the_wire_is_refused_and_the_full_version_fetched(tmp_path, zmq_pub):
    state = _state()
    catchup = WeightCatchup(tmp_path, zmq_pub.cfg, timeout_s=20)
    catchup.commit(catchup.prepare(zmq_pub.publish(1, state)))
    _step(state, 2)
    ready = zmq_pub.publish(2, state)
    _corrupt_delta_frames(zmq_pub.server, 2)
    update = catchup.prepare(ready)
    assert update.route == "full" and update.failures and update.fallback.split(":")[0] in ("checksum", "corrupt")
    _same(update.hold, _published(state))


def test_a_server_dying_mid_transfer_fails_within_the_deadline_and_keeps_the_held_weights(tmp_path):
    class Dying(WeightServer):
        die_after = 10 ** 9

        def _handle(self, sock, frames):
            if self.served_chunks >= self.die_after:
                self._stop.set()  # the socket closes: nothing more is answered, as if the process died
                return
            super()._handle(sock, frames)

    server = Dying(chunk_bytes=1024, deltas=True)
    try:
        g = torch.Generator().manual_seed(3)
        state = {f"t{i}": torch.randn(64, 64, generator=g) for i in range(8)}
        cfg = TrainerConfig(publish_mode="zmq", weight_server_port=0)
        catchup = WeightCatchup(tmp_path, cfg, timeout_s=2.0)
        catchup.commit(catchup.prepare(server.publish(1, _published(state))))
        held = catchup.held
        for t in state.values():
            t.add_(torch.randn(64, 64, generator=g))  # a dense change: one delta chunk per tensor
        ready = server.publish(2, _published(state))
        assert ready.delta_chunks > 2
        server.die_after = server.served_chunks + 2
        t0 = time.monotonic()
        with pytest.raises(WeightsFetchError, match="trainer may have died") as err:
            catchup.prepare(ready)
        assert not isinstance(err.value, DeltaError) and time.monotonic() - t0 < 8
        assert catchup.held is held and catchup.held_version == 1
    finally:
        server.close()


def test_disk_deltas_snapshots_pruning_and_a_corrupt_delta_file(tmp_path):
    cfg = TrainerConfig(publish_mode="disk", weight_deltas="on", full_every=4, keep_weight_versions=2)
    pub = WeightPublisher(cfg, tmp_path)
    root = tmp_path / "weights"
    state = _state()
    catchup = WeightCatchup(tmp_path, cfg, timeout_s=20)
    readies = {}
    for v in range(1, 11):
        _step(state, v)
        readies[v] = pub.publish(v, state)
        if v <= 2:
            catchup.commit(catchup.prepare(readies[v]))
    # full at v1 (no base) and every 4th; a snapshot and the deltas after it are pruned together
    assert disk_versions(root) == [8, 9, 10]
    assert (root / "v8" / FULL_FILE).is_file() and not (root / "v9" / FULL_FILE).exists()
    assert all((root / f"v{v}" / DELTA_FILE).is_file() for v in (8, 9, 10))
    with pytest.raises(WeightsFetchError, match="no \\*.safetensors"):
        read_disk(root / "v9")  # a delta directory is never read as weights
    # a worker at v2 (its chain is pruned): full v8 + deltas 9, 10
    update = catchup.prepare(readies[10])
    assert update.route == "full+chain" and update.fallback.startswith("base")
    _same(update.hold, _published(state))
    catchup.commit(update)
    # corrupt the next delta on disk: no full v11 exists, so no verified way -> a clear error, nothing applied
    _step(state, 11)
    ready = pub.publish(11, state)
    f = root / "v11" / DELTA_FILE
    raw = bytearray(f.read_bytes())
    raw[-20] ^= 0xFF
    f.write_bytes(bytes(raw))
    with pytest.raises(WeightsFetchError, match="no verified way to version 11"):
        catchup.prepare(ready)
    assert catchup.held_version == 10
    # v12 is a snapshot: the worker (at v10) tries the chain through the corrupt v11, then takes the snapshot
    _step(state, 12)
    update = catchup.prepare(pub.publish(12, state))
    assert update.route == "full" and update.fallback.startswith("base") and "corrupt" in update.failures[0]
    _same(update.hold, _published(state))
    catchup.commit(update)
    for v in range(13, 17):  # v16: a snapshot with a delta; the worker holds its base; corrupt that delta
        _step(state, v)
        ready = pub.publish(v, state)
        if v == 16:
            (root / "v16" / DELTA_FILE).write_bytes(b"garbage")
        update = catchup.prepare(ready)
        assert update.route == ("delta" if v < 16 else "full")
        catchup.commit(update)
    assert update.fallback.startswith("corrupt") and update.hold is catchup.held
    _same(update.hold, _published(state))
    # a tampered full snapshot fails its checksums
    bad = root / "v16" / FULL_FILE
    data = bytearray(bad.read_bytes())
    data[-3] ^= 0x01
    bad.write_bytes(bytes(data))
    with pytest.raises(DeltaError, match="differ from the published checksums"):
        read_disk(root / "v16", verify_checksums=True)


def test_version_deltas_need_the_same_tensors():
    with pytest.raises(ValueError, match="same tensors"):
        encode_version({"a": torch.zeros(2)}, {"b": torch.zeros(2)})


def test_the_fetch_deadline_grows_with_the_bytes_to_move(tmp_path):
    """rollout.weights_min_mbps: 60 s + a 15 GB version at 50 MB/s = 360 s, not the 60 s a 270 MB model needed;
    running out names both knobs."""
    from areal_mq.messages import WeightsLink, WeightsReady
    from areal_mq.weights.catchup import _largest_bytes, fetch_budget_s

    assert fetch_budget_s(60.0, 15_000_000_000, 50.0) == pytest.approx(360.0)
    assert fetch_budget_s(60.0, 0, 50.0) == 60.0
    ready = WeightsReady(version=3, mode="zmq", endpoint="tcp://127.0.0.1:1", num_chunks=1, meta={"bytes": 100},
                         links=[WeightsLink(version=3, chunks=2, bytes=5000), WeightsLink(version=3, base=2, chunks=1,
                                                                                          bytes=40)])
    assert _largest_bytes(ready) == 5000
    catchup = WeightCatchup(tmp_path, TrainerConfig(publish_mode="zmq"), timeout_s=1.0, min_mbps=0.001)
    catchup.budget_s = fetch_budget_s(1.0, 5000, 0.001)
    assert catchup.budget_s == pytest.approx(6.0)
    with pytest.raises(WeightsFetchError, match="rollout.weights_min_mbps 0.001 MB/s"):
        catchup._left(time.monotonic() - 1, "full v3")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.int64, torch.uint8, torch.bool])
@pytest.mark.parametrize("changed", [0, 40, 3000])
def test_the_device_diff_gives_frames_that_apply_bit_exactly(dtype, changed):
    """The torch path a GPU rank takes (forced here on CPU tensors): same sparse frame as numpy's, a dense change
    still goes xor, and every frame applies to exactly the new tensor."""
    a, b = _pair(dtype, changed=changed)
    on_dev, host = encode("w", a, b, on_device=True), encode("w", a, b, on_device=False)
    out = apply(a, on_dev)
    assert checksum(out) == checksum(b) == on_dev.checksum
    if on_dev.encoding == host.encoding == "sparse":
        assert on_dev.count == host.count == changed and bytes(on_dev.payload) == bytes(host.payload)
    dense = encode("w", a, ~a if dtype == torch.bool else a + 1, on_device=True)
    assert dense.encoding == "xor" and checksum(apply(a, dense)) == dense.checksum


def test_a_server_diffs_against_the_snapshot_it_was_given_to_diff():
    """WeightServer.publish(diff=...): the delta is computed from the `diff` tensors (a GPU rank's device snapshot)
    and that copy is kept as the next base; receivers holding the host copy still land on the new version."""
    a, b = _pair(torch.bfloat16, changed=25)
    server = WeightServer(deltas=True)
    try:
        server.publish(1, {"w": a.clone()}, diff={"w": a.clone()})
        ready = server.publish(2, {"w": b.clone()}, diff={"w": b.clone()})
        assert ready.base == 1 and server._last is not None and server._last[0] == 2
        piece = server._delta[2][1]
        assert piece.nbytes < a.numel() * 2 // 4  # 25 of 4,000 changed: a delta, not the full bytes
        moved = {"w": torch.empty(0)}  # a layout the next version cannot diff against: the chain restarts
        assert server.publish(3, moved, diff=moved).base == -1
    finally:
        server.close()


@pytest.mark.gpu
def test_a_cuda_snapshot_is_diffed_on_the_gpu_and_applies_on_the_host():
    a, b = _pair(torch.bfloat16, n=400_000, changed=5_000)
    d = encode("w", a.cuda(), b.cuda())  # on_device by default: the tensors are on CUDA
    assert d.encoding in ("sparse", "xor") and checksum(apply(a, d)) == checksum(b) == d.checksum
    assert bytes(d.payload) == bytes(encode("w", a, b, on_device=True).payload)
