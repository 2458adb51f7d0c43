"""What the fuzz campaign of issue 40 found, each pinned at the unit level (the inputs themselves are replayed from
tests/fuzz_corpus/ by tests/integration/test_fuzz.py).

1. A zero-length array frame declared with a huge or many-dimensional shape passed the length check (0 == 0) and
   numpy's reshape raised ValueError out of protocol.decode: in a broker that ended the poll loop (the process).
2. A delta file whose manifest named a tensor with a number raised TypeError in apply_version, not DeltaError
   (only DeltaError sends a rollout worker to the full version).
3. Defence in depth: whatever a handler raises, the broker's and the store's socket loops answer Error(internal)
   and go on serving; the store's bad-message warnings are rate-limited like the broker's (a flood of garbage
   wrote one line per frame).
4. A value that does not fit its array's dtype (an int64 token id past int32, a float in an int list, a float64
   past float32) was converted with a silent wrap, truncation or inf instead of refused.
5. The OpenAI endpoint answered HTTP 500 (a TypeError: "unhashable type") to a chat message whose role was a list.
6. The HTTP reward bridge let OverflowError (a reward of hundreds of digits) and RecursionError (JSON nested past
   the parser's limit) out of its parsing instead of HttpRewardError.
7. A Sample whose meta was nested ~500 deep decoded but could not be encoded again (encode recurses per level): the
   store could neither serve it nor compact a log holding it, so it could not start. Bodies deeper than
   protocol.MAX_DEPTH are bad_fields now.
8. A damaged store log record `{"op": "drop", "ids": [...], "reason": <a big nested value>}` was applied, its
   reason str()-ed once per id: a 66 KB record took 8 s to replay and each id kept its own copy of the text
   (tests/fuzz_corpus/crash-store-log-drop-reason-per-id.json). A reason must be a short string and ids a list
   of strings, else the record is quarantined like any other it cannot read.
"""
from __future__ import annotations

import json
import struct

import msgpack
import pytest
import zmq

from areal_mq import protocol
from areal_mq.brokers.job_broker import JobBroker
from areal_mq.brokers.sample_store import SampleStore
from areal_mq.errors import ProtocolError
from areal_mq.messages import Kind, StatsRequest
from areal_mq.testing import RecordingLog


@pytest.mark.parametrize("shape", [[0, 2**63], [0, 2**64 - 1], [1] * 70, [0, 2**40, 2**40], [0, 2**31, 2**31 - 1]])
def test_an_array_shape_numpy_cannot_hold_is_bad_arrays_not_a_crash(shape):
    header = msgpack.packb({"v": 1, "kind": "stats_request", "id": "x", "body": {}, "arrays": [["float64", shape]]})
    with pytest.raises(ProtocolError) as err:
        protocol.decode([header, b"" if 0 in shape else b"\0" * 8])
    assert err.value.code == "bad_arrays" and err.value.msg_id == "x"


def test_zero_length_arrays_of_many_zero_dimensions_still_decode():
    header = msgpack.packb({"v": 1, "kind": "stats_request", "id": "x", "body": {}, "arrays": [["int32", [0] * 32]]})
    assert protocol.decode([header, b""]).kind == Kind.STATS_REQUEST


def test_a_delta_manifest_of_the_wrong_types_is_a_corrupt_delta(tmp_path):
    torch = pytest.importorskip("torch")
    from areal_mq.weights.delta import DeltaError, encode_version
    from areal_mq.weights.disk import DiskDelta

    v1, v2 = {"w": torch.zeros(4)}, {"w": torch.ones(4)}
    path = tmp_path / "model.delta"
    DiskDelta(1, encode_version(v1, v2)).write(path, 2)
    data = path.read_bytes()
    (n,) = struct.unpack_from("<Q", data)
    head = json.loads(data[8:8 + n])
    for field, value in (("name", 1.5), ("count", "3"), ("shape", [4, -1]), ("checksum", None)):
        inner = json.loads(json.loads(data[8:8 + n])["__metadata__"]["delta"])
        inner["tensors"][0][field] = value
        head["__metadata__"]["delta"] = json.dumps(inner)
        body = json.dumps(head).encode()
        path.write_bytes(struct.pack("<Q", len(body)) + body + data[8 + n:])
        with pytest.raises(DeltaError) as err:
            DiskDelta.read(path, 2, 1)
        assert err.value.reason == "corrupt" and "manifest entry 0" in str(err.value), field


class _Buggy(JobBroker):
    """A broker with a bug in its routing: every decoded message raises."""

    def _dispatch_kind(self, *args, **kwargs):
        raise KeyError("a bug")


def _dealer(ctx, addr):
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    sock.connect(addr)
    return sock


def _pump_until(component, sock, timeout_ms=3000):
    for _ in range(timeout_ms // 20):
        if component.sock.poll(20):
            component.handle()
        if sock.poll(0):
            return protocol.decode(sock.recv_multipart())
    return None


def test_a_handler_that_raises_is_answered_internal_and_the_broker_goes_on(tmp_path):
    ctx, log = zmq.Context(), RecordingLog()
    addr = "inproc://buggy"
    broker = _Buggy(ctx, addr, heartbeat_s=1.0, liveness=5, max_queue=10, max_frame_bytes=1 << 16, log=log)
    sock = _dealer(ctx, addr)
    try:
        for _ in range(2):
            sock.send_multipart(protocol.encode(StatsRequest()))
            answer = _pump_until(broker, sock)
            assert answer is not None and answer.msg.code == "internal" and "KeyError" in answer.msg.message
        assert broker.counters["internal_errors"] == 2
        (line,) = log.named("broker.internal_error")  # rate-limited: one line, the second suppressed
        assert "KeyError" in line["error"] and line["where"].startswith("test_fuzz_findings.py:")
        sock.send_multipart([b"\x00garbage"])  # the socket loop still serves
        assert _pump_until(broker, sock).msg.code == "bad_header"
    finally:
        sock.close(0)
        broker.close()
        ctx.term()


def test_a_flood_of_bad_frames_at_the_store_is_answered_but_logged_once_per_peer_and_reason(tmp_path):
    ctx, log = zmq.Context(), RecordingLog()
    store = SampleStore(ctx, "inproc://store", tmp_path, lease_s=10.0, max_frame_bytes=1 << 16, log=log)
    sock = _dealer(ctx, "inproc://store")
    try:
        for _ in range(50):
            sock.send(b"\x00garbage")
        answers = 0
        while answers < 50:
            got = _pump_until(store, sock)
            assert got is not None and got.msg.code == "bad_header"
            answers += 1
        assert len(log.named("store.bad_message")) == 1 and store.counters["refused"] == 50
    finally:
        sock.close(0)
        store.close()
        ctx.term()


@pytest.mark.parametrize("field, value", [("prompt_ids", [2**40]), ("prompt_ids", [1.5]), ("prompt_ids", [True]),
                                          ("prompt_ids", "int64 2**40")])
def test_an_array_value_that_does_not_fit_its_dtype_is_refused_not_wrapped(field, value):
    """4. An int64 token id past the int32 range was cast with a silent wrap (2**40 became 0), a float in an int
    list was truncated, a float64 logprob past float32 became inf: the message was accepted with other values
    than the peer sent. Now bad_fields."""
    import numpy as np

    from areal_mq.messages import GenerateRequest

    if value == "int64 2**40":
        frames = protocol.encode(GenerateRequest(prompt_ids=np.array([1], np.int32)))
        header = msgpack.unpackb(frames[0])
        header["arrays"] = [["int64", [1]]]
        frames = [msgpack.packb(header), np.array([2**40], np.int64).tobytes()]
    else:
        header = msgpack.unpackb(protocol.encode(GenerateRequest(prompt_ids=np.array([1], np.int32)))[0])
        header["body"][field], header["arrays"] = value, []
        frames = [msgpack.packb(header)]
    with pytest.raises(ProtocolError) as err:
        protocol.decode(frames)
    assert err.value.code == "bad_fields" and ("range" in str(err.value) or "list of int32" in str(err.value))


def test_wider_arrays_and_number_lists_that_fit_still_decode():
    import numpy as np

    from areal_mq.messages import GenerateRequest, SeqSample

    assert GenerateRequest(prompt_ids=np.array([1, 2**31 - 1], np.int64)).prompt_ids.dtype == np.int32
    seq = SeqSample(prompt_ids=[1], output_ids=[5, 6], logprobs=[0, -1.5], versions=[0, 0], reward=1.0)
    assert seq.logprobs.dtype == np.float32 and seq.logprobs.tolist() == [0.0, -1.5]
    with pytest.raises(ValueError, match="range"):
        SeqSample(prompt_ids=[1], output_ids=[5], logprobs=np.array([1e300]), versions=[0], reward=1.0)


@pytest.mark.parametrize("where", ["kind", "v", "nd", "dtype"])
def test_a_value_nested_900_deep_is_refused_without_a_recursion_error(where):
    """5. A refusal's message repr'd the peer's value: a list nested ~900 deep raised RecursionError instead."""
    deep: list = [1]
    for _ in range(900):
        deep = [deep]
    header = {"v": 1, "kind": "stats_request", "id": "x", "body": {}}
    if where == "nd":
        header["body"] = {"extra": {"__nd__": deep}}
    elif where == "dtype":
        header["arrays"] = [[deep, [1]]]
    else:
        header[where] = deep
    frames = [msgpack.packb(header)] + ([b"\0"] if where == "dtype" else [])
    with pytest.raises(ProtocolError) as err:
        protocol.decode(frames)
    assert len(str(err.value)) < 2000


def test_a_full_version_whose_checksum_manifest_is_damaged_is_refused_not_trusted(tmp_path):
    """6. A full weights file whose metadata key `checksums` was damaged (or that lists fewer tensors than it holds)
    was read with nothing to check: damaged tensors passed as the published version. Now DeltaError("checksum")."""
    torch = pytest.importorskip("torch")
    from safetensors.torch import save_file

    from areal_mq.weights.delta import DeltaError, checksum
    from areal_mq.weights.disk import read_disk

    good = {"w": torch.ones(3), "b": torch.zeros(2)}
    digests = {k: checksum(v) for k, v in good.items()}
    cases = {"key damaged": {"checksumq": json.dumps(digests)}, "one missing": {"checksums": json.dumps({"w": digests["w"]})},
             "not a map": {"checksums": "[]"}}
    for name, meta in cases.items():
        d = tmp_path / name.replace(" ", "-")
        d.mkdir()
        save_file({"w": torch.full((3,), 2.0), "b": torch.zeros(2)}, str(d / "model.safetensors"), metadata=meta)
        with pytest.raises(DeltaError) as err:
            read_disk(d, verify_checksums=True)
        assert err.value.reason == "checksum", name
    ok = tmp_path / "ok"
    ok.mkdir()
    save_file(good, str(ok / "model.safetensors"), metadata={"checksums": json.dumps(digests)})
    assert torch.equal(read_disk(ok, verify_checksums=True)["w"], good["w"])


@pytest.mark.parametrize("role", [[1, 2], {"a": 1}, None, 3])
def test_a_chat_message_whose_role_is_not_a_string_is_a_400_not_a_500(role):
    from areal_mq.openai.api import ApiError, ApiLimits, parse_messages

    with pytest.raises(ApiError) as err:
        parse_messages([{"role": role, "content": "hi"}], ApiLimits())
    assert err.value.status == 400 and "role" in str(err.value.body())


@pytest.mark.parametrize("body", [b'{"rewards": [' + b"9" * 400 + b', 0]}',
                                  b'{"rewards": [0, 0], "details": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"])
def test_a_reward_server_answer_python_cannot_hold_is_an_http_reward_error(body):
    from areal_mq.rewards.config import HttpBridgeConfig
    from areal_mq.rewards.http_bridge import HttpRewardBridge, HttpRewardError

    bridge = HttpRewardBridge(HttpBridgeConfig(url="http://127.0.0.1:9/score"))
    with pytest.raises(HttpRewardError) as err:
        bridge._parse(200, body, 2)
    assert not err.value.retryable and "unusable body" in str(err.value)


def test_a_body_nested_past_max_depth_is_bad_fields_and_what_decodes_encodes_again():
    from areal_mq.messages import Sample, SeqSample

    import numpy as np

    def nest(d):
        v = 1
        for _ in range(d):
            v = {"a": v}
        return v

    seq = SeqSample(prompt_ids=np.arange(3, dtype=np.int32), output_ids=np.arange(2, dtype=np.int32),
                    logprobs=np.zeros(2, np.float32), versions=np.zeros(2, np.int32), reward=1.0)
    frames = [bytes(memoryview(f)) for f in protocol.encode(Sample(sample_id="s", prompt_id="p", seqs=[seq]))]
    header = msgpack.unpackb(frames[0], raw=False)
    for depth, ok in ((protocol.MAX_DEPTH - 5, True), (500, False)):
        header["body"]["meta"] = nest(depth)
        frames[0] = msgpack.packb(header, use_bin_type=True)
        if ok:
            protocol.encode(protocol.decode(frames).msg)  # accepted: encodes again
        else:
            with pytest.raises(ProtocolError) as err:
                protocol.decode(frames)
            assert err.value.code == "bad_fields" and "nested deeper" in str(err.value)


def test_a_store_log_record_with_a_huge_reason_or_ids_that_are_not_strings_is_quarantined(tmp_path):
    from areal_mq.brokers.sample_log import SampleLog

    log_file = SampleLog(tmp_path / "samples.log")
    log_file.append({"op": "drop", "ids": ["a", "b"], "reason": "stale"})
    log_file.append({"op": "drop", "ids": [f"x{i}" for i in range(2000)], "reason": [[list(range(50))] * 40]})
    log_file.append({"op": "ack", "ids": [1, 2]})
    log_file.append({"op": "lease", "batch": "b1", "ids": {"not": "a list"}})
    log_file.close()
    ctx = zmq.Context()
    store = SampleStore(ctx, "inproc://store-log", tmp_path, lease_s=10.0, max_frame_bytes=1 << 20, log=RecordingLog())
    try:
        assert store.log_file.bad_records == 3
        assert list(store.dropped_recent) == [("a", "stale"), ("b", "stale")]
        assert "x0" not in store.done
    finally:
        store.close()
        ctx.term()
