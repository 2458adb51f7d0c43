"""Sharded publishing without a process group: two ShardPublishers in one process (rank 0 and rank 1, slices cut by
hand with FSDP2's dim-0 rule), the manifest's checks, and a worker's catch-up across them.
The FSDP ranks themselves are in tests/integration/test_sharded_weights.py."""
from __future__ import annotations

import threading

import pytest
import torch

from areal_mq.algorithms.config import TrainerConfig
from areal_mq.errors import WeightsFetchError
from areal_mq.messages import WeightsReady, WeightsShard
from areal_mq.weights import check_ready
from areal_mq.weights.catchup import WeightCatchup
from areal_mq.weights.delta import DeltaError, checksum
from areal_mq.weights.sharded import ShardPublisher, assemble, check_manifest, chunk_rows

CFG = dict(strategy="fsdp", publish_mode="zmq", publish_layout="sharded", shard_publish_timeout_s=5.0)


def _model(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"embed.weight": torch.randn(63, 64, generator=g).to(torch.bfloat16),
            "norm.weight": torch.randn(64, generator=g).to(torch.bfloat16),
            "one.weight": torch.randn(1, 3, generator=g).to(torch.bfloat16)}


def _slices(model: dict, rank: int, world: int) -> tuple[dict, dict]:
    out, where = {}, {}
    for name, t in model.items():
        start, rows = chunk_rows(t.shape[0], world, rank)
        if rows:
            out[name] = t[start:start + rows].clone()
            where[name] = (start, rows, list(t.shape))
    return out, where


@pytest.mark.parametrize("rows,world", [(7, 2), (1, 2), (8, 4), (5, 8), (0, 3)])
def test_chunk_rows_tile_every_row_once(rows, world):
    spans = [chunk_rows(rows, world, r) for r in range(world)]
    assert sum(n for _, n in spans) == rows
    at = 0
    for start, n in spans:
        if n:
            assert start == at
            at += n
    assert spans == [(min(r * -(-rows // world), rows), len(torch.arange(rows).chunk(world)[r])
                      if r < len(torch.arange(rows).chunk(world)) else 0) for r in range(world)]


def test_manifest_fields_are_checked():
    with pytest.raises(ValueError, match="one entry per slice"):
        WeightsShard(rank=0, endpoint="tcp://127.0.0.1:1", names=["a"], starts=[0], rows=[1], shapes=[[2]],
                     checksums=[])
    with pytest.raises(ValueError, match="exceed its shape"):
        WeightsShard(rank=0, endpoint="tcp://127.0.0.1:1", names=["a"], starts=[1], rows=[2], shapes=[[2]],
                     checksums=["x"])
    shard = WeightsShard(rank=0, endpoint="tcp://127.0.0.1:1")
    with pytest.raises(ValueError, match="served over zmq"):
        WeightsReady(version=1, mode="disk", shards=[shard])
    with pytest.raises(ValueError, match="rank twice"):
        WeightsReady(version=1, mode="zmq", shards=[shard, shard])


def _ready(*shards: tuple[int, list[tuple[str, int, int, list[int]]]]) -> WeightsReady:
    return WeightsReady(version=3, mode="zmq", endpoint="tcp://127.0.0.1:5000", shards=[
        WeightsShard(rank=r, endpoint=f"tcp://127.0.0.1:{5000 + r}", names=[s[0] for s in sl],
                     starts=[s[1] for s in sl], rows=[s[2] for s in sl], shapes=[s[3] for s in sl],
                     checksums=["0" * 32] * len(sl)) for r, sl in shards])


def test_manifest_slices_must_tile_each_tensor():
    good = _ready((0, [("w", 0, 2, [4, 2])]), (1, [("w", 2, 2, [4, 2])]))
    assert check_manifest(good)["w"][0] == [4, 2]
    with pytest.raises(WeightsFetchError, match="gap or overlap"):
        check_manifest(_ready((0, [("w", 0, 3, [4, 2])]), (1, [("w", 2, 2, [4, 2])])))
    with pytest.raises(WeightsFetchError, match="cover 3 rows"):
        check_manifest(_ready((0, [("w", 0, 2, [4, 2])]), (1, [("w", 2, 1, [4, 2])])))
    with pytest.raises(WeightsFetchError, match="on rank 1"):
        check_manifest(_ready((0, [("w", 0, 2, [4, 2])]), (1, [("w", 2, 2, [4, 3])])))


def test_a_shard_endpoint_must_be_that_ranks_weight_server(tmp_path):
    ready = _ready((0, [("w", 0, 2, [4, 2])]), (1, [("w", 2, 2, [4, 2])]))
    assert check_ready(ready, tmp_path, TrainerConfig(**CFG)) is None
    assert check_ready(ready, tmp_path, TrainerConfig(**CFG, weight_server_port=5000)) is None
    why = check_ready(ready, tmp_path, TrainerConfig(**CFG, weight_server_port=4000))
    assert "trainer rank 0's weight server" in why
    moved = ready.model_copy(update={"shards": [ready.shards[0], ready.shards[1].model_copy(
        update={"endpoint": "tcp://10.9.9.9:5001"})]})
    assert "trainer rank 1's" in check_ready(moved, tmp_path, TrainerConfig(**CFG))


def test_assemble_names_the_rank_whose_slice_is_wrong():
    a, b = torch.ones(2, 2), torch.zeros(2, 2)
    ready = _ready((0, [("w", 0, 2, [4, 2])]), (1, [("w", 2, 2, [4, 2])]))
    shards = [ready.shards[0].model_copy(update={"checksums": [checksum(a)]}),
              ready.shards[1].model_copy(update={"checksums": [checksum(a)]})]
    ready = ready.model_copy(update={"shards": shards})
    with pytest.raises(DeltaError, match="trainer rank 1"):
        assemble(ready, check_manifest(ready), [{"w": a}, {"w": b}])


@pytest.fixture
def two_ranks():
    cfg = TrainerConfig(**CFG)
    zero = ShardPublisher(cfg, rank=0, world=2)
    one = ShardPublisher(cfg, rank=1, world=2, exchange=lambda _: zero.collector)
    yield zero, one
    zero.close()
    one.close()


def _publish_both(zero, one, version: int, model: dict) -> WeightsReady | None:
    result = {}
    t = threading.Thread(target=lambda: result.update(ready=zero.publish(version, _slices(model, 0, 2))))
    t.start()
    assert one.publish(version, _slices(model, 1, 2)) is None
    t.join(30)
    return result["ready"]


def test_two_ranks_publish_a_manifest_and_a_worker_follows_it_by_deltas(tmp_path, two_ranks):
    zero, one = two_ranks
    worker = WeightCatchup(tmp_path, TrainerConfig(**CFG), timeout_s=10.0)
    routes = []
    for v in range(1, 5):
        model = _model(0)
        if v > 1:
            model["embed.weight"][v * 7, :3] += 1  # a few elements change, on one rank or the other
            model["norm.weight"][v] += 1
        ready = _publish_both(zero, one, v, model)
        assert [s.rank for s in ready.shards] == [0, 1] and ready.meta["world"] == 2
        assert "one.weight" not in ready.shards[1].names  # one row: rank 0 holds all of it
        update = worker.prepare(WeightsReady.model_validate(ready.model_dump()))
        assert {k: checksum(t) for k, t in update.hold.items()} == {k: checksum(t) for k, t in model.items()}
        worker.commit(update)
        routes.append(update.route)
    assert routes == ["full", "delta", "delta", "delta"]


def test_a_missing_rank_is_named_and_its_version_not_announced(two_ranks):
    zero, _one = two_ranks
    zero.cfg = zero.cfg.model_copy(update={"shard_publish_timeout_s": 0.5})
    logged = []

    class Log:
        def error(self, event, **kw):
            logged.append((event, kw))

        warning = error

    zero.log = Log()
    assert zero.publish(1, _slices(_model(0), 0, 2)) is None
    assert logged[0][0] == "trainer.shard_missing" and logged[0][1]["missing_ranks"] == [1]


def test_the_collector_refuses_what_is_not_a_rank_shard(two_ranks):
    import zmq

    from areal_mq.protocol import encode

    zero, one = two_ranks
    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    push.linger = 1000
    push.connect(zero.collector)
    push.send_multipart([b"\x00garbage"])
    push.send_multipart(encode(WeightsReady(version=1, mode="zmq", shards=[
        WeightsShard(rank=7, endpoint="tcp://127.0.0.1:1")])))  # no such rank
    push.close()
    ctx.term()
    for _ in range(2):  # read here: inside a publish, rank 1's real shard may come first and end the collection
        assert zero._pull.poll(5000)
        assert zero._receive() == (None, -1)
    assert zero.refused == 2
    ready = _publish_both(zero, one, 1, _model(1))
    assert ready is not None and [s.rank for s in ready.shards] == [0, 1]


def test_a_rank_that_cannot_bind_the_weight_host_says_what_to_do():
    cfg = TrainerConfig(**CFG, weight_server_host="192.0.2.1")  # TEST-NET: no interface here has it
    with pytest.raises(WeightsFetchError, match="publish_layout: gather"):
        ShardPublisher(cfg, rank=1, world=2, exchange=lambda _: "tcp://127.0.0.1:1")


def test_the_layout_is_resolved_and_a_sharded_layout_without_shards_is_refused():
    assert TrainerConfig(strategy="fsdp", publish_mode="zmq").sharded_publish
    assert not TrainerConfig(strategy="fsdp", publish_mode="disk").sharded_publish
    assert not TrainerConfig(strategy="fsdp", publish_mode="zmq", publish_layout="gather").sharded_publish
    with pytest.raises(ValueError, match="needs strategy fsdp and publish_mode zmq"):
        TrainerConfig(strategy="ddp", publish_mode="zmq", publish_layout="sharded")


def test_fifty_sharded_updates_leave_the_worker_bit_identical(tmp_path, two_ranks):
    """The issue's target: after 50 sharded updates (deltas each time, a full every trainer.full_every in the chain)
    the worker holds exactly the published weights, checked after every update."""
    zero, one = two_ranks
    worker = WeightCatchup(tmp_path, TrainerConfig(**CFG), timeout_s=10.0)
    model = _model(3)
    g = torch.Generator().manual_seed(9)
    routes = set()
    for v in range(1, 51):
        for t in model.values():
            flat = t.view(-1)
            hit = torch.rand(flat.numel(), generator=g) < 0.03
            flat[hit] = (flat[hit].float() * 1.01 + 0.01).to(t.dtype)
        update = worker.prepare(_publish_both(zero, one, v, model))
        assert {k: checksum(t) for k, t in update.hold.items()} == {k: checksum(t) for k, t in model.items()}, v
        worker.commit(update)
        routes.add(update.route)
    assert routes == {"full", "delta"}


def test_ranks_on_several_hosts_each_serve_from_their_own_address():
    """trainer.weight_server_hosts: rank r binds its own host (127.0.0.2 stands for a second node: all of 127/8 is
    loopback) and check_ready accepts each rank only at its own address; the config refuses a list that does not
    start with weight_server_host or that sharded publishing does not use."""
    from areal_mq.weights import check_ready

    cfg = TrainerConfig(**{**CFG, "weight_server_hosts": ["127.0.0.1", "127.0.0.2"]})
    zero = ShardPublisher(cfg, rank=0, world=2, exchange=lambda c: c)
    one = ShardPublisher(cfg, rank=1, world=2, exchange=lambda _: zero.collector)
    try:
        assert zero.endpoint.startswith("tcp://127.0.0.1:") and one.endpoint.startswith("tcp://127.0.0.2:")
        ready = _publish_both(zero, one, 1, _model(1))
        assert ready is not None and check_ready(ready, "/nonexistent", cfg) is None
        swapped = ready.model_copy(deep=True)
        swapped.shards[1].endpoint = swapped.shards[1].endpoint.replace("127.0.0.2", "127.0.0.1")
        assert "trainer rank 1's weight server (tcp://127.0.0.2:PORT)" in check_ready(swapped, "/nonexistent", cfg)
    finally:
        zero.close()
        one.close()
    with pytest.raises(ValueError, match=r"weight_server_hosts\[0\].*must equal trainer.weight_server_host"):
        TrainerConfig(**{**CFG, "weight_server_hosts": ["127.0.0.2", "127.0.0.1"]})
    with pytest.raises(ValueError, match="only sharded publishing has"):
        TrainerConfig(weight_server_hosts=["127.0.0.1"])
    with pytest.raises(ValueError, match="host names or IPv4"):
        TrainerConfig(**{**CFG, "weight_server_hosts": ["127.0.0.1", "tcp://evil:1"]})
    with pytest.raises(WeightsFetchError, match="lists 2 hosts for a trainer of 3 ranks"):
        ShardPublisher(cfg, rank=2, world=3, exchange=lambda _: "tcp://127.0.0.1:1")
