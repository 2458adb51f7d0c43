"""The one module that builds and parses ZeroMQ frames.

What: a message on the wire is `[routing...] header [array frames...]`. The header is one msgpack map

    {"v": 1, "kind": "generate_result", "id": "9f0c...", "reply_to": "...", "service": "...",
     "body": {... fields; every numpy array replaced by {"__nd__": i}},
     "arrays": [["int32", [512]], ["float32", [512]], ...]}

and array i travels as raw little-endian bytes in the i-th frame after the header (zero-copy where
pyzmq allows). docs/protocol.md is the full specification, written for implementers in any language.
Why: one place for framing means one place for the checks — every decode failure is a ProtocolError
with a short `code`, which the receiver turns into an Error reply instead of crashing.
"""
from __future__ import annotations

import math
import reprlib
import uuid
from dataclasses import dataclass
from typing import Any, Sequence

import msgpack
import numpy as np
from pydantic import ValidationError
from zmq import Frame as _ZmqFrame

from areal_mq.errors import ProtocolError
from areal_mq.messages import MESSAGE_TYPES, PROTOCOL_VERSION, Error, Kind, Message

ND_KEY = "__nd__"
MAX_DEPTH = 100  # containers nested in a message body at most (bad_fields beyond; encode recurses per level)
ALLOWED_DTYPES = {"int32", "float32", "uint8", "int64", "float64", "int16", "uint16", "bool"}
DEFAULT_MAX_FRAME_BYTES = 512 * 1024 * 1024  # 512 MiB; configurable per socket owner
MAX_HEADER_BYTES = 4 * 1024 * 1024
MAX_DIMS = 32  # dimensions of one array (numpy's own limit is 32 or 64, by version)
MAX_ARRAY_BYTES = 2**63 - 1  # the product of an array's non-zero dimensions times its item size: numpy's limit
# Read-only lookup tables for the hot path (a broker decodes every header): dict lookups instead of
# Enum(...) / np.dtype(...) / np.prod(...) calls, which dominate a small message's decode time.
_DTYPES = {name: np.dtype(name) for name in ALLOWED_DTYPES}
_KINDS = {k.value: k for k in Kind}


@dataclass
class Envelope:
    """A decoded message: the typed body plus the envelope fields brokers route on."""

    msg: Message
    id: str
    reply_to: str = ""
    service: str = ""

    @property
    def kind(self) -> Kind:
        return self.msg.kind


def new_id() -> str:
    return uuid.uuid4().hex


def _extract(value: Any, arrays: list[np.ndarray]) -> Any:
    if isinstance(value, np.ndarray):
        arrays.append(np.ascontiguousarray(value))
        return {ND_KEY: len(arrays) - 1}
    if isinstance(value, dict):
        return {k: _extract(v, arrays) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_extract(v, arrays) for v in value]
    if isinstance(value, np.generic):
        return value.item()
    return value


def encode(
    msg: Message,
    *,
    id: str | None = None,
    reply_to: str = "",
    service: str = "",
) -> list[Any]:
    """Frames (header + arrays) for `msg`, without routing frames. Arrays are sent without copies."""
    arrays: list[np.ndarray] = []
    body = _extract(msg.model_dump(), arrays)
    header = {
        "v": PROTOCOL_VERSION,
        "kind": msg.kind.value,
        "id": id or new_id(),
        "reply_to": reply_to,
        "service": service,
        "body": body,
        "arrays": [[a.dtype.name, list(a.shape)] for a in arrays],
    }
    return [msgpack.packb(header, use_bin_type=True), *arrays]


_SHOW = reprlib.Repr()  # (keyword arguments only from Python 3.12)
_SHOW.maxlevel, _SHOW.maxlist, _SHOW.maxdict, _SHOW.maxstring, _SHOW.maxother = 3, 8, 4, 80, 80


def _show(value: Any) -> str:
    """A short repr of a peer's value for an error message: bounded in depth and length, so a 900-deep list cannot
    raise RecursionError while its refusal is written (found by fuzzing)."""
    return _SHOW.repr(value)


def _frame_bytes(frame: Any) -> memoryview | bytes:
    buf = getattr(frame, "buffer", None)  # zmq.Frame received with copy=False
    return buf if buf is not None else frame


def _nbytes(frame: Any) -> int:
    if type(frame) is bytes or type(frame) is _ZmqFrame:  # the common cases: len() is the byte size
        return len(frame)
    return memoryview(_frame_bytes(frame)).nbytes


def decode_header(frames: Sequence[Any], max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> dict:
    """Parse and check the envelope only (version, kind, id, array table vs frames).

    Cheap enough for a broker's hot path; raises ProtocolError naming the problem.
    """
    if not frames:
        raise ProtocolError("empty message: expected a msgpack header frame", "bad_frames")
    raw = _frame_bytes(frames[0])
    size = _nbytes(frames[0])
    if size > MAX_HEADER_BYTES:
        raise ProtocolError(f"header frame is {size} bytes (limit {MAX_HEADER_BYTES})", "too_large")
    try:
        header = msgpack.unpackb(raw, raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises several unrelated types for garbage
        raise ProtocolError(f"header is not valid msgpack: {type(exc).__name__}", "bad_header") from None
    if not isinstance(header, dict):
        raise ProtocolError(f"header must be a msgpack map, got {type(header).__name__}", "bad_header")
    msg_id = header.get("id") if isinstance(header.get("id"), str) else None
    version = header.get("v")
    if type(version) is not int or version != PROTOCOL_VERSION:  # `v: true` equals 1 in Python: refused too
        raise ProtocolError(
            f"protocol version {_show(version)}; this peer speaks version {PROTOCOL_VERSION}", "bad_version", msg_id
        )
    kind = header.get("kind")
    header["kind"] = _KINDS.get(kind) if isinstance(kind, str) else None
    if header["kind"] is None:
        known = ", ".join(k.value for k in Kind)
        raise ProtocolError(f"unknown message kind {_show(kind)}; known kinds: {known}", "unknown_kind", msg_id)
    if msg_id is None or not msg_id:
        raise ProtocolError("header field 'id' must be a non-empty string", "bad_header")
    for key in ("reply_to", "service"):
        if not isinstance(header.get(key, ""), str):
            raise ProtocolError(f"header field {key!r} must be a string", "bad_header", msg_id)
    _check_arrays(header, frames, max_frame_bytes, msg_id)
    return header


def _check_arrays(header: dict, frames: Sequence[Any], max_frame_bytes: int, msg_id: str) -> None:
    table = header.get("arrays", [])
    if not isinstance(table, list):
        raise ProtocolError("header field 'arrays' must be a list", "bad_arrays", msg_id)
    if len(table) != len(frames) - 1:
        raise ProtocolError(
            f"header describes {len(table)} array frame(s) but {len(frames) - 1} followed", "bad_arrays", msg_id
        )
    for i, entry in enumerate(table):
        if not (isinstance(entry, list) and len(entry) == 2 and isinstance(entry[1], list)):
            raise ProtocolError(f"array {i}: descriptor must be [dtype, shape]", "bad_arrays", msg_id)
        dtype, shape = entry
        np_dtype = _DTYPES.get(dtype) if isinstance(dtype, str) else None
        if np_dtype is None:
            raise ProtocolError(f"array {i}: dtype {_show(dtype)} not allowed", "bad_arrays", msg_id)
        if len(shape) > MAX_DIMS:
            raise ProtocolError(f"array {i}: {len(shape)} dimensions (at most {MAX_DIMS})", "bad_arrays", msg_id)
        for d in shape:
            if type(d) is not int or d < 0:  # bool is an int subclass; a shape of True is refused too
                raise ProtocolError(f"array {i}: shape {_show(shape)} must be non-negative ints", "bad_arrays", msg_id)
        # a zero dimension makes the frame empty, but numpy still refuses [0, 2**40, 2**40] or a dimension past
        # 2**63: so the other dimensions are bounded too (a ValueError out of decode once ended a broker's loop)
        if math.prod(d for d in shape if d) * np_dtype.itemsize > MAX_ARRAY_BYTES:
            raise ProtocolError(f"array {i}: shape {_show(shape)} of {dtype} is larger than any array can be",
                                "bad_arrays", msg_id)
        nbytes = _nbytes(frames[i + 1])
        if nbytes > max_frame_bytes:
            raise ProtocolError(
                f"array {i}: frame of {nbytes} bytes exceeds the limit of {max_frame_bytes}", "too_large", msg_id
            )
        expect = math.prod(shape) * np_dtype.itemsize
        if nbytes != expect:
            raise ProtocolError(
                f"array {i}: declared {dtype}{shape} = {expect} bytes but the frame has {nbytes}", "bad_arrays", msg_id
            )


def _array_ref(ref: dict, arrays: list[np.ndarray]) -> np.ndarray:
    idx = ref[ND_KEY]
    if type(idx) is not int or not 0 <= idx < len(arrays):  # not bool: {"__nd__": true} is no reference
        raise ProtocolError(f"array reference {_show(idx)} out of range", "bad_arrays")
    return arrays[idx]


def _inject(value: Any, arrays: list[np.ndarray]) -> Any:
    """Replace every {"__nd__": i} in a freshly unpacked body by arrays[i], in place; refuse a body nested deeper
    than MAX_DEPTH (bad_fields).

    Iterative and in place because this walk runs for every message a broker routes: no call per
    container and no rebuilt dicts. (Assigning to an existing key while iterating a dict is allowed.)
    The depth bound: what is accepted must encode again (encode's walk recurses; fuzzing found a Sample whose meta
    was nested 500 deep accepted by the store, which then failed to serve it and, at its next start, to compact
    its log).
    """
    if type(value) is dict and len(value) == 1 and ND_KEY in value:
        return _array_ref(value, arrays)
    stack = [(value, 1)] if type(value) in (dict, list) else []
    while stack:
        node, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise ProtocolError(f"body nested deeper than {MAX_DEPTH} levels", "bad_fields")
        for key, item in (node.items() if type(node) is dict else enumerate(node)):
            kind = type(item)
            if kind is dict:
                if len(item) == 1 and ND_KEY in item:
                    node[key] = _array_ref(item, arrays)
                else:
                    stack.append((item, depth + 1))
            elif kind is list:
                stack.append((item, depth + 1))
    return value


def decode(frames: Sequence[Any], max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> Envelope:
    """Frames (without routing) -> validated Envelope; raises ProtocolError naming the problem."""
    header = decode_header(frames, max_frame_bytes)
    return decode_body(header, frames)


def decode_body(header: dict, frames: Sequence[Any]) -> Envelope:
    """Second half of decode(): arrays + pydantic validation of the body fields."""
    msg_id = header["id"]
    try:
        arrays = [
            np.frombuffer(_frame_bytes(f), dtype=_DTYPES[d]) if len(s) == 1 else
            np.frombuffer(_frame_bytes(f), dtype=_DTYPES[d]).reshape(s)  # 1-d: the length was checked already
            for f, (d, s) in zip(frames[1:], header.get("arrays", []))
        ]
    except (ValueError, TypeError) as exc:  # _check_arrays bounds shapes; numpy has the last word
        raise ProtocolError(f"arrays: {exc}", "bad_arrays", msg_id) from None
    body = header.get("body", {})
    if not isinstance(body, dict):
        raise ProtocolError("header field 'body' must be a map", "bad_fields", msg_id)
    cls = MESSAGE_TYPES[header["kind"]]
    try:
        # strict: the wire types are exactly the documented ones (no "4" for an int, no true for a number)
        msg = cls.model_validate(_inject(body, arrays), strict=True)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or '<body>'}: {e['msg']}" for e in exc.errors()[:5]
        )
        raise ProtocolError(f"invalid {cls.__name__} fields: {problems}", "bad_fields", msg_id) from None
    except ProtocolError as exc:
        exc.msg_id = msg_id
        raise
    return Envelope(msg=msg, id=msg_id, reply_to=header.get("reply_to", ""), service=header.get("service", ""))


def peek_reply_to(frames: Sequence[Any]) -> str:
    """The header's `reply_to` of a message that failed to decode, or "" (best effort, for error paths).

    A broker uses it to find the job a refused reply was meant for. A header over the size limit is not
    read (that is what the limit is for)."""
    if not frames or _nbytes(frames[0]) > MAX_HEADER_BYTES:
        return ""
    try:
        header = msgpack.unpackb(_frame_bytes(frames[0]), raw=False, strict_map_key=False)
    except Exception:  # noqa: BLE001 - garbage has no reply_to
        return ""
    reply_to = header.get("reply_to") if isinstance(header, dict) else None
    return reply_to if isinstance(reply_to, str) else ""


def where(exc: BaseException) -> str:
    """file:line of the innermost frame `exc` was raised in (for an `internal` error's log line)."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return f"{tb.tb_frame.f_code.co_filename.rsplit('/', 1)[-1]}:{tb.tb_lineno}" if tb is not None else "?"


def error_reply(exc: ProtocolError) -> list[Any]:
    """Frames of an Error answering a message that failed to decode."""
    return encode(Error(code=exc.code, message=str(exc), ref_id=exc.msg_id or ""), reply_to=exc.msg_id or "")


def split_router(frames: Sequence[Any]) -> tuple[bytes, list[Any]]:
    """A ROUTER socket's message -> (peer identity, message frames). One identity frame, no delimiter."""
    if len(frames) < 2:
        raise ProtocolError("message has no frames after the routing identity", "bad_frames")
    ident = frames[0]
    return (ident.bytes if hasattr(ident, "bytes") else bytes(ident)), list(frames[1:])


def topic_frames(topic: str, msg: Message) -> list[Any]:
    """Frames for the signal bus: [topic, header, arrays...]."""
    return [topic.encode(), *encode(msg)]


def decode_topic(frames: Sequence[Any], max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> tuple[str, Envelope]:
    if len(frames) < 2:
        raise ProtocolError("signal message needs a topic frame and a header frame", "bad_frames")
    topic = bytes(_frame_bytes(frames[0])).decode("utf-8", "replace")
    return topic, decode(frames[1:], max_frame_bytes)
