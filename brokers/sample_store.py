"""Sample store: durable queue of finished, rewarded groups between the controller and the trainer.

Dataflow:  controller --Sample--> store --Ack (after the log write)
           trainer --GetBatch(n, version, η)--> store --SampleBatch--> trainer --BatchAck--> store --Ack

Invariants:
- a Sample is acknowledged only after it is appended to the log, so an acknowledged sample survives a
  store crash; a duplicate put (same sample_id) is acknowledged and ignored;
- a served batch is leased, not removed: it is served again if the lease expires, if a trainer asks with
  `release_leases` (a restarted trainer); leases are in the log, so a store restart keeps them (a live
  trainer that trained a batch acks it later; it is neither served again nor dropped as stale meanwhile);
- an acked sample is never served again (acks are in the log and replayed);
- a sample whose oldest generated token is older than `version - max_staleness` is never served: it is
  dropped, logged with the reason, and counted by length bucket; every drop is reported exactly once to the
  trainer, in the `dropped_stale` of the next batch served (drops while no batch is ready wait for one; the
  count is not durable: a store restart forgets the unreported ones);
- with CURVE keys only the controller puts samples and only the trainer takes and acks them (anyone
  authenticated may ask for stats); others get Error(forbidden);
- a full disk (a log write fails with ENOSPC, EDQUOT or EFBIG) changes nothing: every write comes before the
  state it records, a failed write leaves no bytes (sample_log.py), and the request is answered
  Error(disk_full), which a StoreClient retries until its deadline; lease expiry and parked requests wait for
  the next tick;
- memory is bounded: at most `max_samples` held (a put beyond: Error store_full), `max_waiters` parked
  GetBatch requests (the oldest is answered empty), waits cut to `max_wait_ms`, the newest `max_done_ids`
  acked/dropped ids remembered; the log is replayed record by record and compacted (live samples and the
  remembered ids only, rewritten atomically) once it passes `compact_bytes` and is mostly dead records.
Log format, checksums and what replay does with a damaged record: brokers/sample_log.py.
"""
from __future__ import annotations

import collections
import errno
import itertools
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq

from areal_mq import protocol
from areal_mq.brokers.sample_log import SampleLog
from areal_mq.errors import ProtocolError, full_disk_errno
from areal_mq.messages import Ack, Error, Heartbeat, Kind, Sample, SampleBatch, Stats, length_bucket
from areal_mq.security import Keyring, RateLimited, peer_role, refusal

DROPPED_RECENT = 1000  # stats()["dropped_recent"]: the controller settles the groups the store dropped
MAX_DROP_REASON = 64  # the store writes "stale"; a longer reason in the log is a damaged record
_ID_CHUNK = 10_000  # ids per record when the log is compacted (keeps every record small)
ACTIONS = {Kind.SAMPLE: "store:put", Kind.GET_BATCH: "store:take", Kind.BATCH_ACK: "store:take",
           Kind.STATS_REQUEST: "stats"}


def _record_ids(rec: dict) -> list[str]:
    """A log record's sample ids: a list of strings (what the store writes), else TypeError (quarantined)."""
    ids = rec["ids"]
    if not isinstance(ids, list) or not all(isinstance(x, str) for x in ids):
        raise TypeError("a record's ids must be a list of strings")
    return ids


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


class SampleStore:
    def __init__(self, ctx: zmq.Context, address: str, store_dir: str | Path, *, lease_s: float,
                 max_frame_bytes: int, log: Any, fsync: bool = False, keys: Keyring | None = None,
                 max_samples: int = 10_000, max_waiters: int = 256, max_wait_ms: int = 60_000,
                 max_done_ids: int = 1_000_000, compact_bytes: int = 256 << 20):
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        # a frame over the limits is dropped by libzmq, which disconnects its sender (no Error answer)
        self.sock.setsockopt(zmq.MAXMSGSIZE, max_frame_bytes + protocol.MAX_HEADER_BYTES)
        self.secure = keys is not None and keys.secure
        if keys is not None:
            keys.server(self.sock, address)
        self.refusals = RateLimited(log)
        self.sock.bind(address)
        self.lease_s, self.max_frame_bytes, self.log = lease_s, max_frame_bytes, log
        self.max_samples, self.max_waiters, self.max_wait_ms = max_samples, max_waiters, max_wait_ms
        self.max_done_ids, self.compact_bytes = max_done_ids, compact_bytes
        self.samples: dict[str, Sample] = {}  # pending or leased, by id
        self.record_bytes: dict[str, int] = {}  # size of each held sample's put record (live bytes of the log)
        self.pending: collections.deque[str] = collections.deque()
        self.leases: dict[str, Lease] = {}
        self.done: collections.OrderedDict[str, None] = collections.OrderedDict()  # acked or dropped: never served again (the newest max_done_ids)
        self.dropped_recent: collections.deque[tuple[str, str]] = collections.deque(maxlen=DROPPED_RECENT)
        self.waiters: list[Waiter] = []
        self.counters: collections.Counter = collections.Counter()
        self.drops_by_bucket: collections.Counter = collections.Counter()
        self.unreported_stale = 0  # stale drops not yet reported in a served batch's dropped_stale
        self.log_file = SampleLog(Path(store_dir) / "samples.log", fsync, log=log)
        self._replay()

    @classmethod
    def from_config(cls, ctx: zmq.Context, b: Any, store_dir: str | Path, log: Any,
                    keys: Keyring | None = None) -> "SampleStore":
        """The store as `b` (a BrokerConfig) describes it."""
        return cls(ctx, b.store_addr, store_dir, lease_s=b.lease_s, max_frame_bytes=int(b.max_frame_mb * (1 << 20)),
                   log=log, fsync=b.fsync, keys=keys, max_samples=b.store_max_samples,
                   max_waiters=b.store_max_waiters, max_wait_ms=b.store_max_wait_ms,
                   max_done_ids=b.store_max_done_ids, compact_bytes=int(b.store_compact_mb * (1 << 20)))

    # ------------------------------------------------------------ the log
    def _replay(self) -> None:
        t0 = time.monotonic()
        for offset, nbytes, rec in self.log_file.replay():
            try:
                self._apply(rec, nbytes)
            except (ProtocolError, KeyError, TypeError, ValueError, AttributeError) as exc:
                self.log_file.quarantine(offset, nbytes, f"{type(exc).__name__}: {exc}")
        for lease in self.leases.values():  # an acked batch's lease has no release record: its ids are gone
            lease.sample_ids = [x for x in lease.sample_ids if x in self.samples]
        leased = {x for lease in self.leases.values() for x in lease.sample_ids}
        self.leases = {b: lease for b, lease in self.leases.items() if lease.sample_ids}
        self.pending.extend(s for s in self.samples if s not in self.done and s not in leased)
        self.log.info("store.replayed", leased=len(leased), pending=len(self.pending), done=len(self.done),
                      bytes=self.log_file.size, bad_records=self.log_file.bad_records,
                      seconds=round(time.monotonic() - t0, 3))
        if self.log_file.legacy or self.log_file.bad_records or self._compact_due():
            self.compact()

    def _apply(self, rec: Any, nbytes: int) -> None:
        """One replayed record; raises on a record this store cannot read (the caller skips it)."""
        op = rec["op"]
        if op == "put":
            sample = protocol.decode(rec["frames"], self.max_frame_bytes).msg
            if not isinstance(sample, Sample):
                raise TypeError(f"a put record holds a {sample.kind.value}, not a sample")
            if sample.sample_id not in self.done:
                self.samples[sample.sample_id] = sample
                self.record_bytes[sample.sample_id] = nbytes
        elif op == "lease":  # a served batch survives a store restart: it is not served or dropped again
            ids = [x for x in _record_ids(rec) if x in self.samples]
            taken = set(ids)
            for lease in self.leases.values():
                lease.sample_ids = [x for x in lease.sample_ids if x not in taken]
            self.leases[str(rec["batch"])] = Lease(str(rec["batch"]), ids, b"", time.monotonic() + self.lease_s)
        elif op == "release":
            self.leases.pop(str(rec["batch"]), None)
        elif op in ("ack", "drop", "done"):
            ids = _record_ids(rec)
            reason = rec.get("reason", "") if op == "drop" else ""
            if not isinstance(reason, str) or len(reason) > MAX_DROP_REASON:
                # a damaged record's reason was once str()-ed per id: a 66 KB record took 8 s (fuzz, issue 40)
                raise ValueError(f"a drop record's reason must be a string of at most {MAX_DROP_REASON} characters")
            for sid in ids:
                self._forget(sid)
            if op == "drop":
                self.dropped_recent.extend((sid, reason) for sid in ids)
        else:
            raise ValueError(f"unknown op {op!r}")

    def _forget(self, sid: str) -> None:
        """`sid` is acked or dropped: never served again; remember only the newest max_done_ids."""
        self.samples.pop(sid, None)
        self.record_bytes.pop(sid, None)
        self.done[sid] = None
        while len(self.done) > self.max_done_ids:
            self.done.popitem(last=False)

    def _compact_due(self) -> bool:
        size = self.log_file.size
        return size >= self.compact_bytes and size - sum(self.record_bytes.values()) >= size // 2

    def compact(self) -> None:
        """Rewrite the log as: the held samples (put order), the remembered done ids, the recent drops."""
        t0, before = time.monotonic(), self.log_file.size
        recent = {sid for sid, _ in self.dropped_recent}
        done = [sid for sid in self.done if sid not in recent]

        def fill(new: SampleLog) -> None:
            for sid, sample in self.samples.items():
                self.record_bytes[sid] = new.append_put(protocol.encode(sample))
            for lease in self.leases.values():
                new.append({"op": "lease", "batch": lease.batch_id, "ids": lease.sample_ids})
            for i in range(0, len(done), _ID_CHUNK):
                new.append({"op": "done", "ids": done[i:i + _ID_CHUNK]})
            drops = list(self.dropped_recent)
            for i in range(0, len(drops), _ID_CHUNK):
                for reason in dict.fromkeys(r for _, r in drops[i:i + _ID_CHUNK]):
                    ids = [sid for sid, r in drops[i:i + _ID_CHUNK] if r == reason]
                    new.append({"op": "drop", "ids": ids, "reason": reason})

        self.log_file.rewrite(fill)
        self.counters["compactions"] += 1
        self.log.info("store.log_compacted", bytes_before=before, bytes_after=self.log_file.size,
                      samples=len(self.samples), done=len(self.done), seconds=round(time.monotonic() - t0, 3))

    # ------------------------------------------------------------ input
    def handle(self) -> None:
        for _ in range(64):
            try:
                raw = self.sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            try:
                self._on_message(raw)
            except Exception as exc:  # noqa: BLE001 - a bug must not end the poll loop: answer `internal`, go on
                self.counters["internal_errors"] += 1
                self.refusals.error("store.internal_error", key=f"internal:{type(exc).__name__}",
                                    error=f"{type(exc).__name__}: {str(exc)[:300]}", where=protocol.where(exc))
                if len(raw) >= 2:
                    self._send(raw[0].bytes, protocol.encode(Error(code="internal", message=(
                        f"the sample store failed on this message ({type(exc).__name__}); it was dropped"))))

    def _on_message(self, raw: list) -> None:
        try:
            ident, frames = protocol.split_router(raw)
            env = protocol.decode(frames, self.max_frame_bytes)
        except ProtocolError as exc:
            self.counters["refused"] += 1  # a flood of bad frames: one line per peer and reason every 10 s
            peer = raw[0].bytes.hex() if len(raw) >= 2 else ""
            self.refusals.warning("store.bad_message", key=f"{peer}:{exc.code}", code=exc.code, error=str(exc)[:500],
                                  peer=peer)
            if len(raw) >= 2:
                self._send(raw[0].bytes, protocol.error_reply(exc))
            return
        kind = env.kind
        why = refusal(peer_role(raw[0], self.secure), ACTIONS[kind]) if kind in ACTIONS else None
        if why:
            self.counters["forbidden"] += 1
            self.refusals.warning("store.forbidden", key=kind.value, kind=kind.value, error=why)
            self._send(ident, protocol.encode(Error(code="forbidden", message=why, ref_id=env.id), reply_to=env.id))
        elif kind in (Kind.SAMPLE, Kind.GET_BATCH, Kind.BATCH_ACK):
            try:
                if kind == Kind.SAMPLE:
                    self._on_put(ident, env, frames)
                elif kind == Kind.GET_BATCH:
                    self._on_get(ident, env.id, env.msg)
                else:
                    self._on_ack(ident, env.id, env.msg)
            except OSError as exc:
                if not self._disk_full(exc, kind.value):
                    raise
                self._send(ident, protocol.encode(Error(code="disk_full", message=(
                    f"the sample store could not write its log ({errno.errorcode.get(exc.errno, exc.errno)}: no "
                    "space on its disk); nothing of this request was recorded: send it again"), ref_id=env.id),
                    reply_to=env.id))
        elif kind == Kind.HEARTBEAT:
            self._send(ident, protocol.encode(Heartbeat(peer_id="store"), reply_to=env.id))
        elif kind == Kind.STATS_REQUEST:
            self._send(ident, protocol.encode(Stats(data=self.stats()), reply_to=env.id))
        else:
            self._send(ident, protocol.encode(Error(code="bad_request", message=(
                f"the sample store does not take {kind.value} messages"), ref_id=env.id), reply_to=env.id))

    def _disk_full(self, exc: OSError, doing: str) -> bool:
        """Count and log (rate-limited) a log write that met a full disk; False for any other OSError."""
        if full_disk_errno(exc) is None:
            return False
        self.counters["disk_full"] += 1
        self.refusals.warning("store.disk_full", key="disk_full", doing=doing, error=f"{exc}"[:200],
                              hint="free space on the run directory's disk; requests are refused with disk_full "
                                   "and retried by their senders meanwhile")
        return True

    def _on_put(self, ident: bytes, env: protocol.Envelope, frames: list) -> None:
        sample: Sample = env.msg
        sid = sample.sample_id
        duplicate = sid in self.samples or sid in self.done
        if not duplicate and len(self.samples) >= self.max_samples:
            self.counters["store_full"] += 1
            self.refusals.warning("store.full", key="store_full", samples=len(self.samples))
            self._send(ident, protocol.encode(Error(code="store_full", message=(
                f"the sample store holds {len(self.samples)} samples (brokers.store_max_samples); put this one "
                "again once the trainer has taken some"), ref_id=env.id), reply_to=env.id))
            return
        if not duplicate:
            self.record_bytes[sid] = self.log_file.append_put(frames)
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
            self._forget(sid)
        self.counters["acked"] += len(ids)
        if ids and self._compact_due():
            self.compact()
        return len(ids)

    def _on_get(self, ident: bytes, req_id: str, msg: Any) -> None:
        if msg.release_leases:
            for lease in list(self.leases.values()):
                self._release(lease, "trainer restarted")
        if msg.skip_ids:  # ids a resumed trainer already trained on (from its checkpoint)
            self._mark_done(msg.skip_ids)
        wait_ms = min(msg.timeout_ms, self.max_wait_ms)  # longer waits are cut: the client asks again
        waiter = Waiter(ident, req_id, msg, time.monotonic() + wait_ms / 1000.0)
        if self._try_serve(waiter):
            return
        if wait_ms > 0:
            if len(self.waiters) >= self.max_waiters:  # the oldest is most likely a client that went away
                self.counters["waiters_evicted"] += 1
                self._reply_empty(self.waiters.pop(0))
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
                self._forget(sid)
                self.dropped_recent.append((sid, "stale"))
            self.counters["dropped_stale"] += len(dropped)
            if self._compact_due():
                self.compact()
        return len(dropped)

    def _try_serve(self, waiter: Waiter) -> bool:
        msg = waiter.msg
        self.unreported_stale += self._drop_stale(msg.version, msg.max_staleness)
        if len(self.pending) < msg.n_samples:
            return False
        ids = list(itertools.islice(self.pending, msg.n_samples))
        batch_id = protocol.new_id()
        self.log_file.append({"op": "lease", "batch": batch_id, "ids": ids})  # durable: see _apply; before the state
        for _ in ids:
            self.pending.popleft()
        self.leases[batch_id] = Lease(batch_id, ids, waiter.client, time.monotonic() + self.lease_s)
        batch = SampleBatch(batch_id=batch_id, samples=[self.samples[s] for s in ids],
                            dropped_stale=self.unreported_stale)
        self.unreported_stale = 0
        self._send(waiter.client, protocol.encode(batch, reply_to=waiter.req_id))
        self.counters["served"] += len(ids)
        self.log.debug("store.leased", batch=batch_id, samples=ids, version=msg.version)
        return True

    def _reply_empty(self, waiter: Waiter) -> None:
        self._send(waiter.client, protocol.encode(SampleBatch(batch_id="", samples=[]), reply_to=waiter.req_id))

    def _serve_waiters(self) -> None:
        for waiter in list(self.waiters):  # a served one leaves at once: a write failing mid-way serves none twice
            if self._try_serve(waiter):
                self.waiters.remove(waiter)

    def _release(self, lease: Lease, reason: str) -> None:
        self.log_file.append({"op": "release", "batch": lease.batch_id})
        self.leases.pop(lease.batch_id, None)
        back = [s for s in lease.sample_ids if s in self.samples and s not in self.done]
        self.pending.extendleft(reversed(back))
        self.counters["released"] += len(back)
        self.log.info("store.lease_released", batch=lease.batch_id, samples=len(back), reason=reason)

    def tick(self, now: float) -> None:
        expired = [w for w in self.waiters if w.deadline <= now]
        if expired:
            self.waiters = [w for w in self.waiters if w.deadline > now]
            for w in expired:
                self._reply_empty(w)
        try:
            for lease in [l for l in self.leases.values() if l.expires < now]:
                self._release(lease, "lease expired")
            if self.waiters and self.pending:
                self._serve_waiters()
        except OSError as exc:  # a full disk: what was not written is tried again on the next tick
            if not self._disk_full(exc, "tick"):
                raise

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
                "drops_by_length": dict(self.drops_by_bucket), "log_bytes": self.log_file.size,
                "dropped_recent": [[sid, reason] for sid, reason in self.dropped_recent]}

    def close(self) -> None:
        self.sock.close(0)
        self.log_file.close()
