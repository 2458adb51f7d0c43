"""Fuzz targets for the files a crash (or a damaged disk) can leave behind (issue 40): the sample store's log
and the weight files (a delta, model.delta; a full version, model.safetensors with its checksum manifest).

- `store-log`: a real log written by a SampleStore (puts, leases, acks, drops), in the current v2 format and the
  old v1 one, mutated as bytes (torn tails, flipped bits, inserted garbage, huge declared lengths) or as records
  (a mutated msgpack record re-framed with a valid checksum: what a buggy writer, not a disk, would leave). The
  store must start (replay) without raising, skip what it cannot read, and then serve a new sample.
- `weights-delta`: the delta v1 -> v2 as published by the trainer, mutated as bytes or in its JSON metadata (the
  per-tensor manifest: name, dtype, shape, encoding, count, checksum). Reading and applying it must give exactly
  v2 (the checksums) or raise DeltaError (the worker then fetches the full version). Anything else, or a wrong
  tensor, is a failure.
- `weights-full`: v2's model.safetensors with its checksum manifest in the metadata, mutated the same way;
  reading it as a catching-up worker does (`read_disk(verify_checksums=True)`) must give exactly v2 or raise
  (the worker's caller turns any exception into DeltaError("corrupt")); a wrong tensor is a failure.

Run: through benchmarks/faults/fuzz.py (`--target store-log|weights-delta|weights-full`).
"""
from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import zmq

from areal_mq import protocol
from areal_mq.brokers.sample_log import FILE_MAGIC, _HEAD, _REC_MAGIC
from areal_mq.brokers.sample_store import SampleStore
from areal_mq.messages import Sample

from fuzz_mutate import bytes_op, hostile_value, mutate
from fuzz_targets import CountingLog, PeerFrame, Unexpected, _seq, router_seeds


def _records_v2(data: bytes) -> list[bytes]:
    """The payloads of a well-formed v2 log."""
    out, pos = [], len(FILE_MAGIC)
    while pos + _HEAD.size <= len(data):
        _, n, _ = _HEAD.unpack_from(data, pos)
        out.append(data[pos + _HEAD.size:pos + _HEAD.size + n])
        pos += _HEAD.size + n
    return out


def frame_v2(payloads: list[bytes]) -> bytes:
    import zlib

    out = [FILE_MAGIC]
    for p in payloads:
        n = struct.pack("<I", len(p))
        out.append(struct.pack("<I", _REC_MAGIC) + n + struct.pack("<I", zlib.crc32(p, zlib.crc32(n))) + p)
    return b"".join(out)


def frame_v1(payloads: list[bytes]) -> bytes:
    return b"".join(struct.pack("<I", len(p)) + p for p in payloads)


class StoreLogTarget:
    name = "store-log"

    def __init__(self, root: Path):
        self.root, self.ctx, self.log = root, zmq.Context(), CountingLog()
        self.n = 0
        seed_dir = root / "seed"
        store = self._store(seed_dir)
        put = router_seeds()["sample"]
        for i in range(4):  # a log as a run writes it: puts, a lease, an ack, a stale drop
            frames = protocol.encode(Sample(sample_id=f"s{i}", prompt_id="p", seqs=[_seq(3 + i)]))
            store._on_message([PeerFrame(b"c", None), *frames])
        store._on_message([PeerFrame(b"c", None), *put])
        for msg in (dict(n_samples=2, version=0), dict(n_samples=1, version=9, max_staleness=1)):
            from areal_mq.messages import BatchAck, GetBatch

            store._on_message([PeerFrame(b"t", None), *protocol.encode(GetBatch(**msg))])
        store._on_message([PeerFrame(b"t", None), *protocol.encode(BatchAck(sample_ids=["s0"]))])
        store.close()
        v2 = (seed_dir / "samples.log").read_bytes()
        self.payloads = _records_v2(v2)
        self.seeds = {"log-v2": [v2], "log-v1": [frame_v1(self.payloads)]}

    def _store(self, d: Path) -> SampleStore:
        self.n += 1
        return SampleStore(self.ctx, f"inproc://store-log-{self.n}", d, lease_s=60.0, max_frame_bytes=1 << 16,
                           log=self.log, max_samples=256, compact_bytes=1 << 20)

    def mutate(self, c: Any, seed: str, frames: list[bytes]) -> list[bytes]:
        """Bytes (any damage) or records (mutated payloads, re-framed with valid checksums)."""
        if c.int(0, 1):
            data = frames[0]
            for _ in range(c.int(1, 3)):
                data = bytes_op(c, data)
            return [data]
        payloads = list(self.payloads)
        for _ in range(c.int(1, 3)):
            k = c.int(0, len(payloads) - 1)
            try:
                rec = msgpack.unpackb(payloads[k], raw=False, strict_map_key=False)
            except Exception:  # noqa: BLE001 - mutated into garbage by an earlier round: damage it further
                rec = None
            if not isinstance(rec, dict):
                payloads[k] = bytes_op(c, payloads[k])
                continue
            if rec.get("op") == "put" and isinstance(rec.get("frames"), list) and c.int(0, 1):
                rec["frames"] = mutate(c, [bytes(f) if isinstance(f, (bytes, bytearray)) else b"" for f in rec["frames"]])
            else:
                key = c.choice(sorted(rec) + ["op", "ids", "batch", "frames", "reason"])
                rec[key] = hostile_value(c) if c.int(0, 3) else c.choice(("put", "lease", "release", "ack", "drop",
                                                                         "done", "nope"))
            try:
                payloads[k] = msgpack.packb(rec, use_bin_type=True)
            except (ValueError, TypeError, OverflowError):
                payloads[k] = bytes_op(c, payloads[k])
        return [frame_v1(payloads) if seed == "log-v1" else frame_v2(payloads)]

    def feed(self, frames: list[bytes], role: Any, ident: bytes, seed: str | None, i: int) -> str:
        d = self.root / "case"
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir()
        (d / "samples.log").write_bytes(frames[0])
        store = self._store(d)
        try:
            held = [s for s in store.samples.values() if not isinstance(s, Sample)]
            if held:
                raise Unexpected(f"the replayed store holds a {type(held[0]).__name__}")
            if seed is not None and len(store.samples) + len(store.done) < 5:  # s0..s3, p17-e0: acked or held
                raise Unexpected(f"the intact {seed} log replayed {len(store.samples)} samples, {len(store.done)} done")
            return "replayed" if not store.log_file.bad_records else "quarantined"
        finally:
            store.close()

    def tick(self, k: int) -> None:
        pass

    def size(self) -> dict:
        return {}

    def health(self) -> None:
        d = self.root / "health"
        shutil.rmtree(d, ignore_errors=True)
        store = self._store(d)
        sent: list = []
        store._send = lambda ident, frames: sent.append(frames)
        store._on_message([PeerFrame(b"c", None), *router_seeds()["sample"]])
        store.close()
        if not sent or protocol.decode(sent[0]).kind.value != "ack":
            raise Unexpected("health: a fresh store did not ack a valid sample")

    def wire(self, *a: Any, **k: Any) -> list:
        return []

    def close(self) -> None:
        self.ctx.term()


class WeightsTarget:
    """`delta`: model.delta v1 -> v2; `full`: v2's model.safetensors and its checksum manifest."""

    def __init__(self, root: Path, which: str):
        import torch

        from areal_mq.weights.delta import checksum, encode_version
        from areal_mq.weights.disk import DiskDelta, publish_disk

        self.name, self.which, self.root = f"weights-{which}", which, root
        g = torch.Generator().manual_seed(0)
        self.v1 = {"w": torch.randn(6, 4, generator=g), "b": torch.zeros(5, dtype=torch.bfloat16),
                   "m": torch.tensor([True, False, True])}
        self.v2 = {k: v.clone() for k, v in self.v1.items()}
        self.v2["w"][1, 2] += 1.0
        self.v2["w"][4] *= 2
        self.v2["b"][3] = 7
        digests = {k: checksum(v) for k, v in self.v2.items()}
        self.digests = digests
        weights = root / "weights"
        publish_disk(weights, 1, self.v1, keep=5, digests={k: checksum(v) for k, v in self.v1.items()})
        publish_disk(weights, 2, self.v2, keep=5, delta=DiskDelta(1, encode_version(self.v1, self.v2, digests)),
                     digests=digests)
        name = "model.delta" if which == "delta" else "model.safetensors"
        self.seeds = {name: [(weights / "v2" / name).read_bytes()]}
        self.file = name

    def mutate(self, c: Any, seed: str, frames: list[bytes]) -> list[bytes]:
        """Bytes, or the safetensors JSON header (its metadata: the delta manifest or the checksums)."""
        data = frames[0]
        if c.int(0, 2) == 0:
            for _ in range(c.int(1, 3)):
                data = bytes_op(c, data)
            return [data]
        (n,) = struct.unpack_from("<Q", data)
        head = json.loads(data[8:8 + n])
        meta = head.get("__metadata__", {})
        inner_key = "delta" if self.which == "delta" else "checksums"
        inner = json.loads(meta[inner_key])
        how = c.int(0, 3)
        if how == 0 and self.which == "delta":
            t = c.choice(inner["tensors"])
            t[c.choice(("name", "dtype", "shape", "encoding", "count", "checksum", "extra"))] = _json_safe(
                hostile_value(c))
        elif how == 1:
            if isinstance(inner, dict) and inner:
                key = c.choice(sorted(inner))
                inner[key] = _json_safe(hostile_value(c)) if c.int(0, 1) else None
                if inner[key] is None:
                    del inner[key]
        elif how == 2:
            entry = c.choice(sorted(k for k in head if k != "__metadata__"))
            head[entry][c.choice(("dtype", "shape", "data_offsets"))] = _json_safe(hostile_value(c))
        else:
            meta[inner_key] = c.choice(("", "[]", "{", "null", json.dumps(_json_safe(hostile_value(c)))))
        if how != 3:
            meta[inner_key] = json.dumps(inner)
        head["__metadata__"] = meta
        body = json.dumps(head).encode()
        return [struct.pack("<Q", len(body)) + body + data[8 + n:]]

    def feed(self, frames: list[bytes], role: Any, ident: bytes, seed: str | None, i: int) -> str:
        from areal_mq.errors import WeightsFetchError
        from areal_mq.weights.delta import DeltaError, apply_version, checksum
        from areal_mq.weights.disk import DiskDelta, read_disk

        d = self.root / "case"
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir()
        (d / self.file).write_bytes(frames[0])
        try:
            if self.which == "delta":
                got = apply_version(self.v1, DiskDelta.read(d / self.file, 2, 1))
            else:
                got = read_disk(d, verify_checksums=True)
        except DeltaError as exc:
            return f"refused:{exc.reason}"
        except WeightsFetchError:
            return "refused:missing"
        except Exception as exc:  # noqa: BLE001 - judged below
            if self.which == "delta":  # DiskDelta.read/apply promise DeltaError for any damage
                raise
            return f"refused:{type(exc).__name__}"  # client.fetch_piece turns safetensors' own errors into DeltaError
        wrong = sorted(k for k in self.v2 if k not in got or checksum(got[k]) != self.digests[k])
        if wrong or set(got) != set(self.v2):
            raise Unexpected(f"wrong weights accepted: tensors {wrong or sorted(set(got) ^ set(self.v2))} differ "
                             "from the published version")
        return "answered:v2"

    def tick(self, k: int) -> None:
        pass

    def size(self) -> dict:
        return {}

    def health(self) -> None:
        if self.feed(self.seeds[self.file], None, b"", self.file, 0) != "answered:v2":
            raise Unexpected("health: the intact file no longer reads as v2")

    def wire(self, *a: Any, **k: Any) -> list:
        return []

    def close(self) -> None:
        pass


def _json_safe(value: Any) -> Any:
    """A hostile value JSON can carry (bytes become a string; NaN stays: Python's json writes it)."""
    if isinstance(value, bytes):
        return value.decode("latin-1")
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_json_safe(v) for v in value]
    return value
