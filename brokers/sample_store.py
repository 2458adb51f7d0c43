"""Sample store: durable queue of finished, rewarded groups between the controller and the trainer.

Dataflow:  controller --Sample--> store --Ack (after the log write)
           trainer --GetBatch(n, version, η)--> store --SampleBatch--> trainer --BatchAck--> store --Ack

Invariants:
- a Sample is acknowledged only after it is appended to the log, so an acknowledged sample survives a
  store crash; a duplicate put (same sample_id) is acknowledged and ignored;
- a served batch is leased, not removed: it is served again if the lease expires, if a trainer asks with
  `release_leases` (a restarted trainer), or after a store restart (leases are not persisted);
- an acked sample is never served again (acks are in the log and replayed);
- a sample whose oldest generated token is older than `version - max_staleness` is never served: it is
  dropped, logged with the reason, and counted by length bucket;
- with CURVE keys only the controller puts samples and only the trainer takes and acks them (anyone
  authenticated may ask for stats); others get Error(forbidden).
Log format (run_dir/store/samples.log): records of [u32 little-endian length][msgpack map]; a torn tail
from a crash is cut off at the last complete record on replay.
"""
from __future__ import annotations

import collections
import os
import struct
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack
import zmq

from areal_mq import protocol
from areal_mq.errors import ProtocolError
from areal_mq.messages import Ack, Error, Heartbeat, Kind, Sample, SampleBatch, Stats, length_bucket
from areal_mq.security import Keyring, RateLimited, peer_role, refusal

_LEN = struct.Struct("<I")
_BIN32 = struct.Struct(">BI")  # msgpack bin 32: marker 0xc6, big-endian length
ACTIONS = {Kind.SAMPLE: "store:put", Kind.GET_BATCH: "store:take", Kind.BATCH_ACK: "store:take",
           Kind.STATS_REQUEST: "stats"}


@dataclass
class Lease:
    batch_id: str
    sample_ids: list[str]
    client: bytes
    expires: float


@dataclass
class Waiter:
    client: bytes
    req_id: str
    msg: Any
    deadline: float


class SampleLog:
    """Append-only record log with replay."""

    def __init__(self, path: Path, fsync: bool = False):
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self.fsync = fsync
        self._file = None

    def replay(self) -> list[dict]:
        records: list[dict] = []
        if not self.path.exists():
            return records
        data = self.path.read_bytes()
        pos = good = 0
        while pos + 4 <= len(data):
            (n,) = _LEN.unpack_from(data, pos)
            if pos + 4 + n > len(data):
                break
            try:
                records.append(msgpack.unpackb(data[pos + 4:pos + 4 + n], raw=False))
            except Exception:
                break
            pos += 4 + n
            good = pos
        if good < len(data):
            with open(self.path, "r+b") as f:
                f.truncate(good)
        return records

    def append(self, record: dict) -> None:
        if self._file is None:
            self._file = open(self.path, "ab")
        blob = msgpack.packb(record, use_bin_type=True)
        self._file.write(_LEN.pack(len(blob)))
        self._file.write(blob)
        self._file.flush()
        if self.fsync:
            os.fsync(self._file.fileno())

    def append_put(self, frames: list) -> None:
        """The record {"op": "put", "frames": [bin, ...]}, written without copying the frames.

        Same bytes as append() would write (bin32 for every frame, still valid msgpack for replay), but
        each received buffer goes straight to the file: a 192 MB sample costs one write, not three copies.
        """
        buffers = [memoryview(getattr(f, "buffer", f)).cast("B") for f in frames]
        head = (b"\x82" + msgpack.packb("op") + msgpack.packb("put") + msgpack.packb("frames")
                + msgpack.Packer().pack_array_header(len(buffers)))
        if self._file is None:
            self._file = open(self.path, "ab")
        self._file.write(_LEN.pack(len(head) + sum(5 + b.nbytes for b in buffers)))
        self._file.write(head)
        for buf in buffers:
            self._file.write(_BIN32.pack(0xC6, buf.nbytes))
            self._file.write(buf)
        self._file.flush()
        if self.fsync:
            os.fsync(self._file.fileno())

    def close(self) -> None:
        if self._file:
            self._file.close()


class SampleStore:
    def __init__(self, ctx: zmq.Context, address: str, store_dir: str | Path, *, lease_s: float,
                 max_frame_bytes: int, log: Any, fsync: bool = False, keys: Keyring | None = None):
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.secure = keys is not None and keys.secure
        if keys is not None:
            keys.server(self.sock)
        self.refusals = RateLimited(log)
        self.sock.bind(address)
        self.lease_s, self.max_frame_bytes, self.log = lease_s, max_frame_bytes, log
        self.samples: dict[str, Sample] = {}  # pending or leased, by id
        self.pending: collections.deque[str] = collections.deque()
        self.leases: dict[str, Lease] = {}
        self.done: set[str] = set()  # acked or dropped: never served again
        self.waiters: list[Waiter] = []
        self.counters: collections.Counter = collections.Counter()
        self.drops_by_bucket: collections.Counter = collections.Counter()
        self.log_file = SampleLog(Path(store_dir) / "samples.log", fsync)
        self._replay()

    def _replay(self) -> None:
        for rec in self.log_file.replay():
            if rec["op"] == "put":
                env = protocol.decode(rec["frames"], self.max_frame_bytes)
                self.samples[env.msg.sample_id] = env.msg
            else:
                for sid in rec["ids"]:
                    self.samples.pop(sid, None)
                    self.done.add(sid)
        self.pending.extend(s for s in self.samples if s not in self.done)
        self.log.info("store.replayed", pending=len(self.pending), done=len(self.done))

    # ------------------------------------------------------------ input
    def handle(self) -> None:
        for _ in range(64):
            try:
                raw = self.sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            self._on_message(raw)

    def _on_message(self, raw: list) -> None:
        try:
            ident, frames = protocol.split_router(raw)
            env = protocol.decode(frames, self.max_frame_bytes)
        except ProtocolError as exc:
            self.log.warning("store.bad_message", code=exc.code, error=str(exc))
            if len(raw) >= 2:
                self._send(raw[0].bytes, protocol.error_reply(exc))
            return
        kind = env.kind
        why = refusal(peer_role(raw[0], self.secure), ACTIONS[kind]) if kind in ACTIONS else None
        if why:
            self.counters["forbidden"] += 1
            self.refusals.warning("store.forbidden", key=kind.value, kind=kind.value, error=why)
            self._send(ident, protocol.encode(Error(code="forbidden", message=why, ref_id=env.id), reply_to=env.id))
        elif kind == Kind.SAMPLE:
            self._on_put(ident, env, frames)
        elif kind == Kind.GET_BATCH:
            self._on_get(ident, env.id, env.msg)
        elif kind == Kind.BATCH_ACK:
            self._on_ack(ident, env.id, env.msg)
        elif kind == Kind.HEARTBEAT:
            self._send(ident, protocol.encode(Heartbeat(peer_id="store"), reply_to=env.id))
        elif kind == Kind.STATS_REQUEST:
            self._send(ident, protocol.encode(Stats(data=self.stats()), reply_to=env.id))
        else:
            self._send(ident, protocol.encode(Error(code="bad_request", message=(
                f"the sample store does not take {kind.value} messages"), ref_id=env.id), reply_to=env.id))

    def _on_put(self, ident: bytes, env: protocol.Envelope, frames: list) -> None:
        sample: Sample = env.msg
        sid = sample.sample_id
        duplicate = sid in self.samples or sid in self.done
        if not duplicate:
            self.log_file.append_put(frames)
            self.samples[sid] = sample
            self.pending.append(sid)
            self.counters["put"] += 1
        self._send(ident, protocol.encode(Ack(ref_id=env.id, info={"duplicate": duplicate}), reply_to=env.id))
        self._serve_waiters()

    def _on_ack(self, ident: bytes, req_id: str, msg: Any) -> None:
        acked = self._mark_done(msg.sample_ids)
        self.leases.pop(msg.batch_id, None)
        self._send(ident, protocol.encode(Ack(ref_id=req_id, info={"acked": acked}), reply_to=req_id))

    def _mark_done(self, sample_ids: list[str]) -> int:
        ids = [s for s in sample_ids if s not in self.done]
        if ids:
            self.log_file.append({"op": "ack", "ids": ids})
            gone = set(ids)
            self.pending = collections.deque(s for s in self.pending if s not in gone)
        for sid in ids:
            self.done.add(sid)
            self.samples.pop(sid, None)
        self.counters["acked"] += len(ids)
        return len(ids)

    def _on_get(self, ident: bytes, req_id: str, msg: Any) -> None:
        if msg.release_leases:
            for lease in list(self.leases.values()):
                self._release(lease, "trainer restarted")
        if msg.skip_ids:  # ids a resumed trainer already trained on (from its checkpoint)
            self._mark_done(msg.skip_ids)
        waiter = Waiter(ident, req_id, msg, time.monotonic() + msg.timeout_ms / 1000.0)
        if self._try_serve(waiter):
            return
        if msg.timeout_ms > 0:
            self.waiters.append(waiter)
        else:
            self._reply_empty(waiter)

    # ------------------------------------------------------------ serving
    def _drop_stale(self, version: int, max_staleness: int | None) -> int:
        if max_staleness is None:
            return 0
        floor = version - max_staleness
        dropped = []
        for sid in list(self.pending):
            sample = self.samples[sid]
            oldest = sample.oldest_version()
            if oldest >= 0 and oldest < floor:
                dropped.append(sid)
                bucket = length_bucket(max(len(s.output_ids) for s in sample.seqs))
                self.drops_by_bucket[bucket] += 1
                self.log.info("store.sample_dropped", sample=sid, reason="stale", oldest_version=oldest,
                              version=version, max_staleness=max_staleness, length_bucket=bucket)
        if dropped:
            self.log_file.append({"op": "drop", "ids": dropped, "reason": "stale"})
            drop = set(dropped)
            self.pending = collections.deque(s for s in self.pending if s not in drop)
            for sid in dropped:
                self.done.add(sid)
                self.samples.pop(sid, None)
            self.counters["dropped_stale"] += len(dropped)
        return len(dropped)

    def _try_serve(self, waiter: Waiter) -> bool:
        msg = waiter.msg
        dropped = self._drop_stale(msg.version, msg.max_staleness)
        if len(self.pending) < msg.n_samples:
            return False
        ids = [self.pending.popleft() for _ in range(msg.n_samples)]
        batch_id = protocol.new_id()
        self.leases[batch_id] = Lease(batch_id, ids, waiter.client, time.monotonic() + self.lease_s)
        batch = SampleBatch(batch_id=batch_id, samples=[self.samples[s] for s in ids], dropped_stale=dropped)
        self._send(waiter.client, protocol.encode(batch, reply_to=waiter.req_id))
        self.counters["served"] += len(ids)
        return True

    def _reply_empty(self, waiter: Waiter) -> None:
        self._send(waiter.client, protocol.encode(SampleBatch(batch_id="", samples=[]), reply_to=waiter.req_id))

    def _serve_waiters(self) -> None:
        still = []
        for waiter in self.waiters:
            if not self._try_serve(waiter):
                still.append(waiter)
        self.waiters = still

    def _release(self, lease: Lease, reason: str) -> None:
        self.leases.pop(lease.batch_id, None)
        back = [s for s in lease.sample_ids if s in self.samples and s not in self.done]
        self.pending.extendleft(reversed(back))
        self.counters["released"] += len(back)
        self.log.info("store.lease_released", batch=lease.batch_id, samples=len(back), reason=reason)

    def tick(self, now: float) -> None:
        for lease in [l for l in self.leases.values() if l.expires < now]:
            self._release(lease, "lease expired")
        expired = [w for w in self.waiters if w.deadline <= now]
        if expired:
            self.waiters = [w for w in self.waiters if w.deadline > now]
            for w in expired:
                self._reply_empty(w)
        if self.waiters and self.pending:
            self._serve_waiters()

    def _send(self, ident: bytes, frames: list) -> None:
        if not ident:
            return
        try:
            self.sock.send_multipart([ident, *frames], copy=False)
        except zmq.ZMQError:
            self.counters["send_errors"] += 1

    def stats(self) -> dict:
        return {"pending": len(self.pending), "leased": sum(len(l.sample_ids) for l in self.leases.values()),
                "done": len(self.done), "waiters": len(self.waiters), "counters": dict(self.counters),
                "drops_by_length": dict(self.drops_by_bucket)}

    def close(self) -> None:
        self.sock.close(0)
        self.log_file.close()
