"""Round trips of every message shape (hypothesis) and every kind of bad input decode() must refuse."""
from __future__ import annotations

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from areal_mq import protocol
from areal_mq.errors import ProtocolError
from areal_mq.messages import (Control, Error, GenerateRequest, GenerateResult, RewardJob, Sample, SamplingSpec,
                               SeqSample, WeightsReady)

ints = st.lists(st.integers(-2**31, 2**31 - 1), max_size=300)
floats = st.floats(allow_nan=False, width=32)


def _wire(frames):
    return [bytes(memoryview(f)) for f in frames]  # what really arrives: bytes, not our numpy objects


@given(tokens=ints, temp=st.floats(0, 5), text=st.text(max_size=50), idx=st.integers(0, 1000))
@settings(max_examples=60, deadline=None)
def test_generate_request_round_trip(tokens, temp, text, idx):
    msg = GenerateRequest(prompt_ids=tokens, sampling=SamplingSpec(temperature=temp, stop_strings=[text]),
                          group_id=text, sample_index=idx, meta={"k": [1, text]}, session=text)
    env = protocol.decode(_wire(protocol.encode(msg, service="generate")))
    assert env.service == "generate" and env.msg.session == text
    assert env.msg.prompt_ids.dtype == np.int32
    assert env.msg.prompt_ids.tolist() == tokens
    assert env.msg.sampling == msg.sampling and env.msg.meta == msg.meta


def test_oversized_session_is_refused():
    """A session is a routing/cache key bounded on the wire: a hostile client cannot make it a payload."""
    frames = protocol.encode(GenerateRequest(prompt_ids=[1], session="s"))
    header = msgpack.unpackb(bytes(memoryview(frames[0])), raw=False)
    header["body"]["session"] = "x" * 129
    with pytest.raises(ProtocolError) as exc:
        protocol.decode([msgpack.packb(header)] + _wire(frames[1:]))
    assert exc.value.code == "bad_fields" and "session" in str(exc.value)


@given(n=st.integers(0, 200), data=st.data())
@settings(max_examples=40, deadline=None)
def test_generate_result_and_nested_sample_round_trip(n, data):
    ids = data.draw(st.lists(st.integers(0, 50000), min_size=n, max_size=n))
    lps = data.draw(st.lists(floats, min_size=n, max_size=n))
    vers = data.draw(st.lists(st.integers(-1, 100), min_size=n, max_size=n))
    res = GenerateResult(output_ids=ids, logprobs=lps, versions=vers, finish_reason="length", text="t")
    back = protocol.decode(_wire(protocol.encode(res, reply_to="abc")))
    assert back.reply_to == "abc"
    np.testing.assert_array_equal(back.msg.logprobs, np.asarray(lps, np.float32))
    seq = SeqSample(prompt_ids=[1, 2], output_ids=ids, logprobs=lps, versions=vers, reward=0.5)
    sample = Sample(sample_id="s", seqs=[seq, seq])
    got = protocol.decode(_wire(protocol.encode(sample))).msg
    assert len(got.seqs) == 2 and got.seqs[1].versions.tolist() == vers


@pytest.mark.parametrize("msg", [
    Control(action="shutdown", reason="done"), WeightsReady(version=3, path="/x"),
    RewardJob(task="math", completions=["a", "b"], reference={"x": 1}), Error(code="c", message="m"),
])
def test_plain_messages_round_trip(msg):
    env = protocol.decode(_wire(protocol.encode(msg)))
    assert env.msg == msg and env.kind == msg.kind


def _header(frames):
    return msgpack.unpackb(frames[0], raw=False)


def _with_header(frames, **changes):
    h = _header(frames)
    h.update(changes)
    return [msgpack.packb(h), *frames[1:]]


GOOD = _wire(protocol.encode(GenerateResult(output_ids=[1, 2, 3], logprobs=[0.0] * 3, versions=[0] * 3,
                                            finish_reason="stop")))


@pytest.mark.parametrize("frames, code, words", [
    ([], "bad_frames", "empty"),
    ([b"\xc1\xff garbage"], "bad_header", "msgpack"),
    ([msgpack.packb([1, 2])], "bad_header", "map"),
    (_with_header(GOOD, v=9), "bad_version", "version 9"),
    (_with_header(GOOD, kind="teleport"), "unknown_kind", "teleport"),
    (_with_header(GOOD, id=""), "bad_header", "id"),
    (GOOD[:-1], "bad_arrays", "3 array frame(s) but 2"),
    ([GOOD[0], GOOD[1], GOOD[2], GOOD[3][:4]], "bad_arrays", "frame has 4"),
    (_with_header(GOOD, arrays=[["complex128", [3]], ["float32", [3]], ["int32", [3]]]), "bad_arrays", "complex128"),
])
def test_bad_frames_are_refused_with_a_reason(frames, code, words):
    with pytest.raises(ProtocolError) as info:
        protocol.decode(frames)
    assert info.value.code == code
    assert words in str(info.value)


def test_wrong_field_types_and_length_mismatch_name_the_field():
    h = _header(GOOD)
    h["body"]["finish_reason"] = 7
    with pytest.raises(ProtocolError, match="finish_reason") as info:
        protocol.decode([msgpack.packb(h), *GOOD[1:]])
    assert info.value.code == "bad_fields"
    mismatch = _wire(protocol.encode(GenerateResult.model_construct(
        output_ids=np.zeros(3, np.int32), logprobs=np.zeros(2, np.float32), versions=np.zeros(3, np.int32),
        finish_reason="stop", text="", worker_id="", group_id="", sample_index=0, stats={})))
    with pytest.raises(ProtocolError, match="length mismatch"):
        protocol.decode(mismatch)
    h = _header(GOOD)
    h["body"]["output_ids"] = {"__nd__": 1}  # a float32 frame where int32 is required
    with pytest.raises(ProtocolError, match="int32"):
        protocol.decode([msgpack.packb(h), *GOOD[1:]])


def test_oversized_frame_is_refused():
    big = _wire(protocol.encode(GenerateRequest(prompt_ids=np.zeros(1000, np.int32))))
    with pytest.raises(ProtocolError) as info:
        protocol.decode(big, max_frame_bytes=1000)
    assert info.value.code == "too_large"


def test_error_reply_names_the_problem():
    try:
        protocol.decode(_with_header(GOOD, v=2))
    except ProtocolError as exc:
        env = protocol.decode(_wire(protocol.error_reply(exc)))
    assert env.msg.code == "bad_version" and env.msg.ref_id == _header(GOOD)["id"]


def test_length_buckets_of_drop_reports():
    from areal_mq.messages import length_bucket

    assert [length_bucket(n) for n in (0, 31, 32, 40, 64)] == ["0-31", "0-31", "32-63", "32-63", "64-95"]


def _wire_header(msg, **changes) -> dict:
    header = msgpack.unpackb(protocol.encode(msg)[0], raw=False)
    body = {**header["body"], **changes.pop("body", {})}
    return {**header, **changes, "body": body}


@pytest.mark.parametrize("changes, code, words", [
    ({"v": True}, "bad_version", "True"),  # true == 1 in Python; the doc says int
    ({"v": 1.0}, "bad_version", "1.0"),
    ({"body": {"capacity": "4"}}, "bad_fields", "capacity"),
    ({"body": {"capacity": 4.0}}, "bad_fields", "capacity"),
    ({"body": {"capacity": True}}, "bad_fields", "capacity"),
    ({"body": {"worker_id": b"w"}}, "bad_fields", "worker_id"),  # bin where the doc says str
    ({"body": {"tasks": ["math"] * 257}}, "bad_fields", "tasks"),
    ({"body": {"tasks": ["x" * 129]}}, "bad_fields", "tasks"),
])
def test_wire_types_are_as_strict_as_documented(changes, code, words):
    """Lax pydantic coercion let `v: true`, `capacity: "4"` and bin strings through, unlike docs/protocol.md."""
    from areal_mq.messages import Ready

    frames = [msgpack.packb(_wire_header(Ready(service="s", capacity=1, worker_id="w"), **changes), use_bin_type=True)]
    with pytest.raises(ProtocolError) as info:
        protocol.decode(frames)
    assert info.value.code == code and words in str(info.value)


def test_strict_types_still_take_what_the_doc_allows():
    job = _wire_header(RewardJob(task="t", completions=["a"]), body={"truncated": [True]})
    assert protocol.decode([msgpack.packb(job)]).msg.truncated == [True]
    result = msgpack.packb(_wire_header(Error(code="c", message="m")))
    assert protocol.decode([result]).msg.code == "c"
    from areal_mq.messages import RewardResult
    assert protocol.decode([msgpack.packb(_wire_header(RewardResult(rewards=[1.5]), body={"rewards": [1, 0.5]}))]
                           ).msg.rewards == [1.0, 0.5]  # a msgpack int is a float too
    with pytest.raises(ProtocolError, match="rewards"):
        protocol.decode([msgpack.packb(_wire_header(RewardResult(rewards=[1.5]), body={"rewards": [True]}))])


def test_truncated_needs_one_flag_per_completion():
    header = _wire_header(RewardJob(task="t", completions=["a"]), body={"truncated": [True, False, True]})
    with pytest.raises(ProtocolError, match="truncated has 3 flags for 1") as info:
        protocol.decode([msgpack.packb(header)])
    assert info.value.code == "bad_fields"


def test_peek_reply_to_reads_what_it_can():
    good = protocol.encode(Error(code="c", message="m"), reply_to="job-1")
    assert protocol.peek_reply_to(good) == "job-1"
    assert protocol.peek_reply_to([b"\x00garbage"]) == ""
    assert protocol.peek_reply_to([msgpack.packb({"reply_to": 5})]) == ""
    assert protocol.peek_reply_to([]) == ""
    assert protocol.peek_reply_to([b"\x00" * (protocol.MAX_HEADER_BYTES + 1)]) == ""


def test_adapter_weights_ready_round_trips_and_hostile_forms_are_refused():
    """docs/protocol.md `weights_adapter`: rank and alpha bounded, a hex base checksum, disk or zmq only."""
    from areal_mq.messages import WeightsAdapter

    msg = WeightsReady(version=7, mode="zmq", endpoint="tcp://127.0.0.1:5601", num_chunks=1,
                       adapter=WeightsAdapter(rank=16, alpha=32.0, target_modules=["q_proj"], base_checksum="ab" * 8))
    got = protocol.decode(_wire(protocol.encode(msg))).msg
    assert got == msg and got.adapter.scaling == 2.0
    good = _wire_header(msg)["body"]["adapter"]
    for bad in ({"rank": 0}, {"rank": 4096}, {"alpha": -1.0}, {"base_checksum": "../../etc"},
                {"target_modules": ["x"] * 33}, {"target_modules": ["x" * 65]}, {"code": "import os"}):
        frames = [msgpack.packb(_wire_header(msg, body={"adapter": {**good, **bad}}), use_bin_type=True)]
        with pytest.raises(ProtocolError, match="adapter"):
            protocol.decode(frames)
    frames = [msgpack.packb(_wire_header(msg, body={"mode": "cuda_ipc"}), use_bin_type=True)]
    with pytest.raises(ProtocolError, match="adapter"):
        protocol.decode(frames)
