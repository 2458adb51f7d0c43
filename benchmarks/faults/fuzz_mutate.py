"""Structure-aware mutation of captured valid frames, for benchmarks/faults/fuzz.py and the fuzz tests (issue 40).

What: `mutate(chooser, frames)` turns one valid message (a list of frames: msgpack header + raw array frames, as
`protocol.encode` builds them, or any other byte strings) into a hostile one by 1-4 operations drawn from:
- header fields: a field (top level or anywhere in the body) set to a hostile value of another type (None, huge
  or negative ints, NaN/inf, long or empty strings, bytes, deeply nested lists and maps, array references out of
  range), deleted, or an unknown field added; the kind swapped (a valid kind with the wrong body: type
  confusion), the version changed, the array table given huge declared shapes ([2**62], [0, 2**63], 70 dims),
  foreign dtypes or the wrong number of entries, a body value nested hundreds of levels deep;
- bytes: truncation, bit flips, inserted bytes, and msgpack containers declaring 4 G elements or bytes
  (str32/bin32/array32/map32 prefixes) with nothing behind them;
- frames: dropped, duplicated, swapped, emptied, added, an array frame resized.
The draws come from a `Chooser`: `RandomChooser` (a seeded random.Random: the campaign's volume) or
`DataChooser` (a Hypothesis `data` object: the tests, which shrink a failure to a minimal input). The same
operations either way, so a campaign's finding is a Hypothesis test's finding.

Run: imported by benchmarks/faults/fuzz.py and tests/integration/test_fuzz.py; not a script.
"""
from __future__ import annotations

import math
import random
from typing import Any, Callable, Sequence

import msgpack

KINDS = ("ready", "heartbeat", "disconnect", "generate_request", "generate_result", "reward_job", "reward_result",
         "sample", "episode_job", "episode_result", "get_batch", "sample_batch", "batch_ack", "ack",
         "weights_ready", "weights_fetch", "weights_chunk", "control", "event", "error", "stats_request", "stats")
HUGE_PREFIXES = (b"\xdb\xff\xff\xff\xff", b"\xc6\xff\xff\xff\xff", b"\xdd\xff\xff\xff\xff",
                 b"\xdf\xff\xff\xff\xff", b"\xdc\xff\xff", b"\xde\xff\xff", b"\xd9\xff", b"\xc7\xff\x01")
DTYPES = ("int32", "float32", "uint8", "int64", "float64", "int16", "uint16", "bool", "float16", "object", "<U8",
          "", "complex128", "V8")


class RandomChooser:
    """Draws from a seeded random.Random (reproducible from the seed)."""

    def __init__(self, seed: int):
        self.rng = random.Random(seed)

    def int(self, lo: int, hi: int) -> int:
        return self.rng.randint(lo, hi)

    def choice(self, seq: Sequence[Any]) -> Any:
        return seq[self.rng.randrange(len(seq))]

    def bytes(self, n: int) -> bytes:
        return self.rng.randbytes(n)


class DataChooser:
    """Draws from a Hypothesis `data` object (st.data()): the same operations, shrinkable."""

    def __init__(self, data: Any):
        from hypothesis import strategies as st

        self.data, self.st = data, st

    def int(self, lo: int, hi: int) -> int:
        return self.data.draw(self.st.integers(lo, hi))

    def choice(self, seq: Sequence[Any]) -> Any:
        return seq[self.int(0, len(seq) - 1)]

    def bytes(self, n: int) -> bytes:
        return self.data.draw(self.st.binary(min_size=n, max_size=n))


# ---------------------------------------------------------------- hostile values
def nested(c: Any, depth: int, leaf: Any = 0) -> Any:
    value = leaf
    as_map = c.int(0, 1)
    for _ in range(depth):
        value = {"a": value} if as_map else [value]
    return value


def hostile_value(c: Any) -> Any:
    """A value of a type or size no field expects (or a well-typed one at the edge of its range)."""
    return c.choice(_HOSTILE)(c)


_HOSTILE: tuple[Callable[[Any], Any], ...] = tuple(
    [lambda c, v=v: v for v in (None, True, False, -1, 0, 2**31, 2**63 - 1, -2**63, 2**64 - 1, math.nan, math.inf,
                                -math.inf, 1e308, "", -0.0)] + [
        lambda c: "x" * c.int(1, 70_000),
        lambda c: "\u202e\x00\ud7ff" * c.int(1, 5),
        lambda c: c.bytes(c.int(0, 64)),
        lambda c: nested(c, c.int(1, 400)),
        lambda c: list(range(c.int(0, 3000))),
        lambda c: {f"k{i}": i for i in range(c.int(0, 2000))},
        lambda c: {"__nd__": c.choice((-1, 0, 1, 99, 2**40, "0", None, True))},
        lambda c: [hostile_leaf(c) for _ in range(c.int(1, 8))],
        lambda c: {"__nd__": 0, "extra": 1},
    ])


def hostile_leaf(c: Any) -> Any:
    return c.choice((None, -1, 2**64 - 1, math.nan, "", "a", b"\x00", [], {}, 0.5, True))


# ---------------------------------------------------------------- header-level operations
def _paths(value: Any, prefix: tuple = (), out: list | None = None, limit: int = 200) -> list[tuple]:
    """Paths (key tuples) to every value inside `value` (maps and lists), at most `limit`."""
    out = [] if out is None else out
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        if len(out) >= limit:
            break
        out.append(prefix + (key,))
        if isinstance(item, (dict, list)) and len(item) < 64:
            _paths(item, prefix + (key,), out, limit)
    return out


def _parent(header: dict, path: tuple) -> tuple[Any, Any]:
    node = header
    for key in path[:-1]:
        node = node[key]
    return node, path[-1]


def op_set_field(c: Any, h: dict) -> None:
    paths = _paths(h)
    if paths:
        node, key = _parent(h, c.choice(paths))
        node[key] = hostile_value(c)


def op_delete_field(c: Any, h: dict) -> None:
    paths = [p for p in _paths(h) if isinstance(_parent(h, p)[0], dict)]
    if paths:
        node, key = _parent(h, c.choice(paths))
        del node[key]


def op_add_field(c: Any, h: dict) -> None:
    target = h if c.int(0, 1) or not isinstance(h.get("body"), dict) else h["body"]
    target[c.choice(("extra", "__nd__", "v", "kind", "x" * 300, "", "arrays"))] = hostile_value(c)


def op_kind(c: Any, h: dict) -> None:
    h["kind"] = c.choice(KINDS) if c.int(0, 3) else hostile_value(c)


def op_version(c: Any, h: dict) -> None:
    h["v"] = c.choice((0, 2, True, "1", 1.0, None, -1, 2**64 - 1))


def op_arrays(c: Any, h: dict) -> None:
    table = h.get("arrays") if isinstance(h.get("arrays"), list) else []
    shapes = ([2**62], [0, 2**63], [0, 2**40, 2**40], [1] * 70, [-1], [2**64 - 1], [3, 0.5], [True], [],
              [c.int(0, 10**6)], "4", None)
    entry = [c.choice(DTYPES), c.choice(shapes)]
    how = c.int(0, 4)
    if how == 0 or not table:
        table.append(entry)
    elif how == 1:
        table[c.int(0, len(table) - 1)] = entry
    elif how == 2:
        table.pop()
    elif how == 3:
        table[c.int(0, len(table) - 1)] = hostile_value(c)
    else:
        h["arrays"] = hostile_value(c)
        return
    h["arrays"] = table


def op_nest(c: Any, h: dict) -> None:
    paths = _paths(h.get("body", {})) if isinstance(h.get("body"), dict) else []
    if paths:
        node, key = _parent(h["body"], c.choice(paths))
        node[key] = nested(c, c.int(50, 450), node[key])


def op_ids(c: Any, h: dict) -> None:
    h[c.choice(("id", "reply_to", "service"))] = c.choice(("", "x" * 5000, None, 7, b"id", "job-1", ["a"]))


HEADER_OPS: tuple[Callable[[Any, dict], None], ...] = (op_set_field, op_delete_field, op_add_field, op_kind,
                                                      op_version, op_arrays, op_nest, op_ids)


# ---------------------------------------------------------------- byte- and frame-level operations
def bytes_op(c: Any, data: bytes) -> bytes:
    """One byte-level corruption of `data`."""
    n = len(data)
    how = c.int(0, 5)
    if how == 0:
        return data[:c.int(0, n)]
    if how == 1 and n:
        i = c.int(0, n - 1)
        return data[:i] + bytes([data[i] ^ (1 << c.int(0, 7))]) + data[i + 1:]
    if how == 2:
        i = c.int(0, n)
        return data[:i] + c.bytes(c.int(1, 16)) + data[i:]
    if how == 3:
        i = c.int(0, n)
        return data[:i] + c.choice(HUGE_PREFIXES) + data[i:i + c.int(0, 8)]
    if how == 4 and n:
        i = c.int(0, n - 1)
        return data[:i] + data[i:i + c.int(1, 64)] * c.int(2, 50) + data[i:]
    return c.bytes(c.int(0, 128))


def frames_op(c: Any, frames: list[bytes], max_frame: int) -> list[bytes]:
    """One frame-level change: drop, duplicate, swap, empty, add, resize (up to just past `max_frame`)."""
    out = list(frames)
    how = c.int(0, 6)
    i = c.int(0, max(len(out) - 1, 0))
    if how == 0 and out:
        out.pop(i)
    elif how == 1 and out:
        out.insert(i, out[i])
    elif how == 2 and len(out) > 1:
        j = c.int(0, len(out) - 1)
        out[i], out[j] = out[j], out[i]
    elif how == 3 and out:
        out[i] = b""
    elif how == 4:
        out.append(c.choice((b"", c.bytes(c.int(1, 64)), b"\x00" * c.int(0, 4096))))
    elif how == 5 and len(out) > 1:
        k = c.int(1, len(out) - 1)
        out[k] = out[k][:c.int(0, len(out[k]))] if c.int(0, 1) else out[k] + b"\x00" * c.int(1, 64)
    elif len(out) > 1:
        out[c.int(1, len(out) - 1)] = b"\x00" * c.choice((max_frame, max_frame + 1))
    return out


def _frames_for(table: Any, frames: list[bytes], max_frame: int) -> list[bytes]:
    """Array frames matching `table` where its sizes are computable and small (else empty or as they were)."""
    if not isinstance(table, list):
        return frames
    out = []
    for i, entry in enumerate(table):
        size = None
        if isinstance(entry, list) and len(entry) == 2 and isinstance(entry[1], list):
            dims = entry[1]
            if all(type(d) is int and 0 <= d < 2**40 for d in dims) and len(dims) < 100:
                item = {"int64": 8, "float64": 8, "int32": 4, "float32": 4, "int16": 2, "uint16": 2}.get(
                    entry[0] if isinstance(entry[0], str) else "", 1)
                size = math.prod(dims) * item
        if size is not None and size <= max_frame + 1:
            out.append(b"\x00" * size)
        else:
            out.append(frames[i] if i < len(frames) else b"")
    return out


def mutate(c: Any, frames: list[bytes], max_frame: int = 1 << 16) -> list[bytes]:
    """1-4 operations on a copy of `frames` (frames[0] a msgpack header when it decodes as a map)."""
    out = list(frames)
    for _ in range(c.int(1, 4)):
        layer = c.int(0, 9)
        if layer < 6 and out:  # most inputs keep a decodable header: they reach the deeper checks
            try:
                header = msgpack.unpackb(out[0], raw=False, strict_map_key=False)
            except Exception:  # noqa: BLE001 - already garbage: corrupt it further
                header = None
            if isinstance(header, dict):
                c.choice(HEADER_OPS)(c, header)
                try:
                    out[0] = msgpack.packb(header, use_bin_type=True)
                except (ValueError, TypeError, OverflowError):  # too deep to pack: cut it
                    out[0] = out[0][: len(out[0]) // 2]
                if c.int(0, 1):  # frames that agree with the (mutated) table reach the checks behind it
                    out = out[:1] + _frames_for(header.get("arrays"), out[1:], max_frame)
                continue
        if layer < 8 and out:
            k = c.int(0, len(out) - 1)
            out[k] = bytes_op(c, out[k])
        else:
            out = frames_op(c, out, max_frame)
    return out
