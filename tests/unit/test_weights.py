"""Weight publishing: disk round trip and pruning, zmq round trip over real sockets, refusals, garbage,
and a fetch whose server process is killed failing clearly within its deadline."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
import zmq

from areal_mq.errors import WeightsFetchError
from areal_mq.messages import Error, WeightsReady
from areal_mq.protocol import decode
from areal_mq.weights import WeightServer, fetch_weights, load_published
from areal_mq.weights.disk import disk_versions, publish_disk


def _tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": torch.randn(300, 16, generator=g).to(torch.bfloat16),
        "layer.0.w": torch.randn(16, 32, generator=g),
        "layer.0.b": torch.randn(32, generator=g).to(torch.float16),
        "scale": torch.tensor(3.5),
        "steps": torch.arange(5, dtype=torch.int64),
    }


def _same(a: dict, b: dict) -> None:
    assert list(a) == list(b) or sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape and torch.equal(a[k], b[k]), k


def test_disk_publish_prune_round_trip(tmp_path):
    readies = [publish_disk(tmp_path / "weights", v, _tensors(v), keep=2, hf_config_json='{"a": 1}')
               for v in range(1, 5)]
    assert disk_versions(tmp_path / "weights") == [3, 4]
    assert sorted(p.name for p in (tmp_path / "weights").iterdir()) == ["v3", "v4"]  # no temp dirs left
    last = readies[-1]
    assert last.mode == "disk" and last.version == 4 and last.path.endswith("v4")
    _same(load_published(last), _tensors(4))
    assert json.loads((tmp_path / "weights" / "v4" / "config.json").read_text()) == {"a": 1}
    with pytest.raises(WeightsFetchError, match="pruned"):
        load_published(readies[0])
    # republishing a version replaces it
    publish_disk(tmp_path / "weights", 4, _tensors(9), keep=2)
    _same(load_published(last), _tensors(9))


def test_zmq_round_trip_in_several_chunks():
    server = WeightServer(chunk_bytes=2048, keep=2)
    try:
        ready = server.publish(7, _tensors(7))
        assert ready.mode == "zmq" and ready.endpoint.startswith("tcp://127.0.0.1:") and ready.num_chunks >= 3
        _same(fetch_weights(ready, timeout_s=10), _tensors(7))
        assert server.served_chunks == ready.num_chunks
        # num_chunks unknown (0): learned from the first chunk
        _same(load_published(ready.model_copy(update={"num_chunks": 0}), timeout_s=10), _tensors(7))
        server.publish(8, _tensors(8))
        server.publish(9, _tensors(9))  # keep=2: version 7 is gone
        with pytest.raises(WeightsFetchError, match=r"version 7 is not served here \(available: \[8, 9\]\)"):
            fetch_weights(ready, timeout_s=10)
    finally:
        server.close()


def test_server_answers_garbage_with_an_error_and_keeps_serving():
    server = WeightServer()
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    try:
        ready = server.publish(1, _tensors(1))
        sock.connect(server.endpoint)
        sock.send_multipart([b"\xc1 not msgpack"])
        assert sock.poll(5000)
        reply = decode(sock.recv_multipart()).msg
        assert isinstance(reply, Error) and reply.code == "bad_header"
        _same(fetch_weights(ready, timeout_s=10), _tensors(1))
    finally:
        sock.close(0)
        ctx.term()
        server.close()


def test_a_request_whose_handling_raises_is_logged_and_the_server_keeps_serving(monkeypatch):
    """Found by the weight-server fuzz campaign stalling: an exception in one request's handling ended the server's
    thread, and every later fetch timed out while the trainer kept announcing versions."""
    logged = []

    class Log:
        def error(self, event, **kw):
            logged.append((event, kw))

    server = WeightServer(log=Log())
    try:
        ready = server.publish(1, _tensors(1))
        real, calls = server._lookup, []

        def lookup_raising_once(msg):
            calls.append(msg)
            if len(calls) == 1:
                raise RuntimeError("a bug reached by a strange request")
            return real(msg)

        monkeypatch.setattr(server, "_lookup", lookup_raising_once)
        with pytest.raises(WeightsFetchError):
            fetch_weights(ready.model_copy(update={"num_chunks": 1}), timeout_s=2)
        _same(fetch_weights(ready, timeout_s=10), _tensors(1))  # still serving
        assert server.failed_requests == 1 and logged[0][0] == "weights.server_request_failed"
    finally:
        server.close()


def test_fetch_from_nothing_fails_within_deadline():
    with zmq.Context() as ctx, ctx.socket(zmq.ROUTER) as probe:  # a free port nobody serves
        port = probe.bind_to_random_port("tcp://127.0.0.1")
        probe.linger = 0
    ready = WeightsReady(version=3, mode="zmq", endpoint=f"tcp://127.0.0.1:{port}", num_chunks=2)
    t0 = time.monotonic()
    with pytest.raises(WeightsFetchError, match=r"did not deliver version 3 within 1s \(0/2 chunks"):
        fetch_weights(ready, timeout_s=1.0)
    assert time.monotonic() - t0 < 5.0


SERVER_SCRIPT = """
import sys, time, torch
from areal_mq.weights import WeightServer
server = WeightServer(chunk_bytes=1 << 16)
ready = server.publish(5, {f"w{i}": torch.full((64, 64), float(i)) for i in range(8)})
print(ready.model_dump_json(), flush=True)
time.sleep(300)
"""


@pytest.fixture
def server_process():
    proc = subprocess.Popen([sys.executable, "-c", SERVER_SCRIPT], stdout=subprocess.PIPE, text=True)
    yield proc
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGKILL)
    proc.wait(10)
    proc.stdout.close()


def test_fetch_whose_server_dies_fails_clearly_within_deadline(server_process):
    ready = WeightsReady.model_validate_json(server_process.stdout.readline())
    assert fetch_weights(ready, timeout_s=30)["w3"].eq(3.0).all()  # alive: works
    os.kill(server_process.pid, signal.SIGKILL)
    server_process.wait(10)
    t0 = time.monotonic()
    with pytest.raises(WeightsFetchError) as err:
        fetch_weights(ready, timeout_s=2.0)
    assert time.monotonic() - t0 < 6.0
    text = str(err.value)
    assert ready.endpoint in text and "version 5" in text and "trainer may have died" in text


def test_publisher_serves_a_snapshot_not_the_live_tensors(tmp_path):
    from areal_mq.algorithms.config import TrainerConfig
    from areal_mq.weights import WeightPublisher

    live = {"w": torch.zeros(4, 4), "tied": None}
    live["tied"] = live["w"]  # the same storage under two names: published once
    publisher = WeightPublisher(TrainerConfig(publish_mode="zmq", publish_dtype="float32"), tmp_path)
    try:
        ready = publisher.publish(1, live)
        live["w"].add_(1.0)  # the next training step changes the parameters in place
        got = fetch_weights(ready, timeout_s=10)
    finally:
        publisher.close()
    assert list(got) == ["w"] and torch.equal(got["w"], torch.zeros(4, 4))


def test_deltas_are_on_by_default_for_zmq_and_off_for_disk(tmp_path):
    from areal_mq.algorithms.config import TrainerConfig
    from areal_mq.weights import WeightPublisher

    state = _tensors(1)
    for mode, want in (("zmq", True), ("disk", False)):
        publisher = WeightPublisher(TrainerConfig(publish_mode=mode), tmp_path / mode)
        try:
            publisher.publish(1, state)
            state = {k: v + 1 if v.is_floating_point() else v for k, v in state.items()}
            ready = publisher.publish(2, state)
        finally:
            publisher.close()
        assert (ready.base == 1 and bool(ready.links)) is want, mode
    assert [p.name for p in (tmp_path / "disk" / "weights" / "v2").iterdir()] == ["model.safetensors"]  # as before
