"""Client-side role APIs: submit jobs, talk to the sample store, publish and receive signals.

What: `JobClient` (controller -> job broker), `StoreClient` (controller/trainer -> sample store),
`SignalPublisher` / `SignalSubscriber` (signal bus). They hide framing and liveness: a client code reads
"submit, poll results", never frame juggling.
Why resubmission is safe: job ids are chosen by the client; the broker keeps one copy per id and answers
each once; the client forgets a job at its first answer, so a duplicate answer is ignored here. A caller that
stops waiting calls `JobClient.forget(job_id)`: no more resubmissions, and a late answer is ignored too.
All sockets are single-thread objects: use each client from one thread.
"""
from __future__ import annotations

import random
import time
from typing import Any

import zmq

from areal_mq import protocol
from areal_mq.errors import BrokerUnavailable, JobFailed, ProtocolError
from areal_mq.messages import (Ack, BatchAck, Error, GeneratePartial, GetBatch, Heartbeat, Kind, Message, Sample,
                               SampleBatch, Stats, StatsRequest)
from areal_mq.security import Keyring


def connect_dealer(ctx: zmq.Context, address: str, keys: Keyring | None = None) -> zmq.Socket:
    """A DEALER to a broker (job broker, sample store), the one factory for clients and workers alike: CURVE
    client keys when `keys` is given, no high-water mark either way (credits and deadlines bound what is in
    flight, not the socket), linger 0 (an unsent message at close is resent by its retry schedule, never
    delivered late to a peer that has moved on)."""
    sock = ctx.socket(zmq.DEALER)
    if keys is not None:
        keys.client(sock)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.connect(address)
    return sock


def send(sock: zmq.Socket, frames: list) -> bool:
    """Send without ever blocking; False when no connection takes it now (broker down, or the CURVE
    handshake refused our key). Callers keep the message and send it again on their retry schedule."""
    try:
        sock.send_multipart(frames, zmq.NOBLOCK, copy=False)
        return True
    except zmq.Again:
        return False


class Backoff:
    """Reconnect delays (docs/protocol.md §5.4): start at `start_s`, double after each attempt up to `max_s`.

    Each delay is jittered down to half (`base * uniform(0.5, 1)`) so that peers which lost the same broker do
    not all come back in the same instant. `reset()` once the broker is heard from again.
    """

    def __init__(self, start_s: float, max_s: float, rng: random.Random | None = None):
        self.start_s, self.max_s = start_s, max(max_s, start_s)
        self.base = start_s  # the un-jittered delay of the next attempt
        self.rng = rng or random.Random()

    def next(self) -> float:
        delay = self.base * self.rng.uniform(0.5, 1.0)
        self.base = min(self.base * 2, self.max_s)
        return delay

    def reset(self) -> None:
        self.base = self.start_s


class Liveness:
    """Paranoid Pirate (zguide ch. 4), written once for every DEALER that talks to a broker (JobClient, the
    worker runtime): a heartbeat every `heartbeat_s`; the broker is lost after `liveness` silent intervals
    plus the current backoff delay, and the caller then reconnects (new socket, resend). Each loss without an
    answer in between doubles the extra delay (Backoff, jittered, capped at `reconnect_max_s`); hearing the
    broker again resets it, so the next outage starts from the shortest wait.
    A broker restarted faster than the liveness window is never silent for long enough: the broker's
    heartbeat answers carry its boot id, and `restarted(peer_id)` tells the caller when it changed (the new
    broker knows none of the old one's jobs or workers)."""

    def __init__(self, heartbeat_s: float, liveness: int, reconnect_max_s: float, rng: random.Random | None = None):
        self.heartbeat_s, self.liveness = heartbeat_s, liveness
        self.backoff = Backoff(heartbeat_s, reconnect_max_s, rng)
        self.delay = 0.0  # extra silence allowed before the next loss: the backoff after a reconnect
        self.last_heard = time.monotonic()
        self.next_beat = 0.0
        self.reconnects = 0
        self.broker_id = ""

    def heard(self) -> None:
        """The broker answered: an outage in progress is over (the backoff starts again from the shortest)."""
        self.last_heard = time.monotonic()
        if self.delay:
            self.backoff.reset()
            self.delay = 0.0

    def restarted(self, peer_id: str) -> bool:
        """A heartbeat answer from broker `peer_id`: True when a broker with another boot id answered before."""
        before, self.broker_id = self.broker_id, peer_id or self.broker_id
        return bool(before and peer_id and peer_id != before)

    def beat_due(self, now: float) -> bool:
        if not self.next_beat:  # the first beat starts the clock (not the constructor: a model may load between)
            self.last_heard = now
        if now < self.next_beat:
            return False
        self.next_beat = now + self.heartbeat_s
        return True

    def silent_s(self, now: float) -> float:
        return now - self.last_heard

    def lost(self, now: float) -> bool:
        return self.silent_s(now) > self.heartbeat_s * self.liveness + self.delay

    def reconnected(self) -> tuple[float, float]:
        """Count a reconnect and start the next, longer wait: (its un-jittered base, the jittered delay)."""
        base, self.delay = self.backoff.base, self.backoff.next()
        self.last_heard = time.monotonic()
        self.reconnects += 1
        return base, self.delay


class JobClient:
    """Submit jobs to services and collect their answers; survives broker restarts by resubmitting."""

    def __init__(self, address: str, *, keys: Keyring | None = None, heartbeat_s: float = 1.0, liveness: int = 5,
                 retry_s: float = 600.0, ctx: zmq.Context | None = None, log: Any = None,
                 reconnect_max_s: float = 8.0):
        self.address, self.retry_s = address, retry_s
        # each reconnect resubmits every pending job, so a broker that stays away is retried less and less often
        self.link = Liveness(heartbeat_s, liveness, reconnect_max_s)
        self.ctx = ctx or zmq.Context.instance()
        self.log = log
        self.keys = keys
        self.sock = connect_dealer(self.ctx, address, keys)
        self.pending: dict[str, tuple[float, list, str]] = {}  # id -> (sent_at, frames, service)
        self._set_aside: list[tuple[str, Message]] = []  # answers wait() received for other jobs

    def submit(self, msg: Message, service: str = "", job_id: str | None = None) -> str:
        job_id = job_id or protocol.new_id()
        frames = protocol.encode(msg, id=job_id, service=service)
        self.pending[job_id] = (time.monotonic(), frames, service)
        send(self.sock, frames)
        return job_id

    def poll(self, timeout: float = 0.0) -> list[tuple[str, Message]]:
        """Answers that arrived within `timeout` seconds: (job id, result message or Error)."""
        out, self._set_aside = self._set_aside, []
        return out + self._receive(0.0 if out else timeout)

    def _receive(self, timeout: float) -> list[tuple[str, Message]]:
        out: list[tuple[str, Message]] = []
        self._liveness()
        if self.sock.poll(int(timeout * 1000), zmq.POLLIN):
            while True:
                try:
                    frames = self.sock.recv_multipart(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                self.link.heard()
                try:
                    env = protocol.decode(frames)
                except ProtocolError as exc:
                    if self.log:
                        self.log.warning("client.bad_reply", error=str(exc))
                    continue
                if env.kind == Kind.HEARTBEAT:
                    if self.link.restarted(env.msg.peer_id):
                        self._resubmit_all("broker restarted")
                    continue
                ref = env.reply_to or getattr(env.msg, "ref_id", "")
                if ref in self.pending and env.kind == Kind.GENERATE_PARTIAL:
                    out.append((ref, env.msg))  # a streamed request's tokens so far: the job is still pending
                elif ref in self.pending:
                    del self.pending[ref]
                    out.append((ref, env.msg))
        return out

    def wait(self, job_id: str, timeout: float) -> Message:
        """Block until `job_id` is answered; raises JobFailed on Error, BrokerUnavailable on timeout.

        Answers to other jobs that arrive meanwhile are kept for the next poll()/wait(), never dropped.
        """
        deadline = time.monotonic() + timeout
        while True:
            for rid, msg in self._set_aside:
                if rid == job_id and not isinstance(msg, GeneratePartial):  # partials are a view: wait() drops them
                    self._set_aside = [(r, m) for r, m in self._set_aside if r != job_id]
                    if isinstance(msg, Error):
                        raise JobFailed(f"job {job_id} failed: [{msg.code}] {msg.message}")
                    return msg
            if time.monotonic() >= deadline:
                raise BrokerUnavailable(f"job {job_id} not answered within {timeout:.1f}s (broker {self.address}; "
                                        "is it running, and is this client's key in its key directory?)")
            self._set_aside.extend(self._receive(min(0.1, max(0.0, deadline - time.monotonic()))))

    def forget(self, job_id: str) -> bool:
        """Give up on `job_id`: it is never resubmitted again and its answer, if one still comes, is dropped.

        For a caller that stopped waiting (cancelled, past its deadline): without this, the job would be sent
        again after every reconnect or `retry_s`, for nobody. True when the job was still unanswered or its
        answer not yet handed out; an unknown or already delivered id is a no-op (False).
        """
        kept = [(rid, msg) for rid, msg in self._set_aside if rid != job_id]
        dropped = len(kept) < len(self._set_aside)
        self._set_aside = kept
        return self.pending.pop(job_id, None) is not None or dropped

    def _liveness(self) -> None:
        now = time.monotonic()
        if self.link.beat_due(now):
            send(self.sock, protocol.encode(Heartbeat(peer_id="client")))
        if self.link.lost(now):
            self._reconnect()
        else:
            for job_id, (sent, frames, _svc) in list(self.pending.items()):
                if now - sent > self.retry_s:
                    self.pending[job_id] = (now, frames, _svc)
                    send(self.sock, frames)

    def _reconnect(self) -> None:
        """The broker went silent: new socket (new identity), resubmit everything still unanswered."""
        self.sock.close(0)
        self.sock = connect_dealer(self.ctx, self.address, self.keys)
        waited = self.link.delay
        _, delay = self.link.reconnected()
        if self.log:
            self.log.warning("client.reconnect", broker=self.address, resubmitting=len(self.pending),
                             waited_s=round(waited, 2), next_retry_in_s=round(delay, 2))
        self._resubmit_all()

    def _resubmit_all(self, why: str = "") -> None:
        if why and self.log:
            self.log.warning("client.resubmit", broker=self.address, reason=why, resubmitting=len(self.pending))
        for job_id, (_, frames, svc) in list(self.pending.items()):
            self.pending[job_id] = (time.monotonic(), frames, svc)
            send(self.sock, frames)

    @property
    def reconnects(self) -> int:
        return self.link.reconnects

    def stats(self, timeout: float = 5.0) -> dict:
        rid = self.submit(StatsRequest())
        msg = self.wait(rid, timeout)
        return msg.data if isinstance(msg, Stats) else {}

    def close(self) -> None:
        self.sock.close(0)


DISK_FULL_RETRY_S = 1.0  # how often a StoreClient sends a request again while the store answers disk_full


class StoreClient:
    """Request/response with the sample store; every call retries across store restarts and a full store disk
    (Error disk_full) until its deadline."""

    def __init__(self, address: str, *, keys: Keyring | None = None, heartbeat_s: float = 1.0,
                 ctx: zmq.Context | None = None, max_frame_bytes: int = protocol.DEFAULT_MAX_FRAME_BYTES):
        self.address, self.heartbeat_s = address, heartbeat_s
        self.ctx = ctx or zmq.Context.instance()
        self.max_frame_bytes = max_frame_bytes
        self.keys = keys
        self.sock = connect_dealer(self.ctx, address, keys)

    def _call(self, msg: Message, timeout: float, resend_s: float) -> Message:
        req_id = protocol.new_id()
        frames = protocol.encode(msg, id=req_id)
        deadline = time.monotonic() + timeout
        while True:
            send(self.sock, frames)
            full = None  # a disk_full answer to this send: resent every DISK_FULL_RETRY_S until the deadline
            resend_at = min(deadline, time.monotonic() + resend_s)
            while time.monotonic() < resend_at:
                if not self.sock.poll(int(max(1, (resend_at - time.monotonic()) * 1000)), zmq.POLLIN):
                    continue
                env = protocol.decode(self.sock.recv_multipart(copy=False), self.max_frame_bytes)
                unmatched = isinstance(env.msg, Error) and not env.reply_to and not env.msg.ref_id
                if env.reply_to != req_id and not unmatched:
                    continue  # a late answer to an earlier attempt
                # An Error naming no request answers one whose id the store could not read (a header over the
                # limit): with one call at a time it can only be this one (waiting would take the whole deadline)
                if isinstance(env.msg, Error) and env.msg.code == "disk_full":
                    full = env.msg
                    time.sleep(min(DISK_FULL_RETRY_S, max(0.0, deadline - time.monotonic())))
                    break
                if isinstance(env.msg, Error):
                    raise JobFailed(f"sample store refused {msg.kind.value}: [{env.msg.code}] {env.msg.message}")
                return env.msg
            if full is not None:
                if time.monotonic() >= deadline:
                    raise JobFailed(f"sample store refused {msg.kind.value} until the deadline ({timeout:.0f} s): "
                                    f"[{full.code}] {full.message}")
                continue  # same socket: the store is up, only its disk is full
            if time.monotonic() >= deadline:
                raise BrokerUnavailable(f"sample store {self.address} did not answer {msg.kind.value} "
                                        f"within {timeout:.1f}s (is it running, and is this client's key in its key "
                                        "directory?)")
            self.sock.close(0)  # store may have restarted: fresh identity, send again (requests are idempotent)
            self.sock = connect_dealer(self.ctx, self.address, self.keys)

    def put(self, sample: Sample, timeout: float = 60.0) -> Ack:
        return self._call(sample, timeout, resend_s=max(5.0, self.heartbeat_s * 5))

    def get_batch(self, n_samples: int, version: int, max_staleness: int | None = None, wait_s: float = 5.0,
                  release_leases: bool = False, skip_ids: list[str] | None = None,
                  timeout: float = 120.0) -> SampleBatch:
        msg = GetBatch(n_samples=n_samples, version=version, max_staleness=max_staleness,
                       timeout_ms=int(wait_s * 1000), release_leases=release_leases, skip_ids=skip_ids or [])
        return self._call(msg, timeout, resend_s=wait_s + max(5.0, self.heartbeat_s * 5))

    def ack(self, batch: SampleBatch | str, sample_ids: list[str] | None = None, timeout: float = 60.0) -> Ack:
        if isinstance(batch, SampleBatch):
            batch_id, sample_ids = batch.batch_id, [s.sample_id for s in batch.samples]
        else:
            batch_id = batch
        return self._call(BatchAck(batch_id=batch_id, sample_ids=sample_ids or []), timeout, resend_s=5.0)

    def stats(self, timeout: float = 10.0) -> dict:
        return self._call(StatsRequest(), timeout, resend_s=5.0).data

    def close(self) -> None:
        self.sock.close(0)


class SignalPublisher:
    """PUB socket connected to the bus's XSUB side."""

    def __init__(self, address: str, ctx: zmq.Context | None = None, keys: Keyring | None = None):
        self.ctx = ctx or zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.PUB)
        self.sock.setsockopt(zmq.LINGER, 500)
        if keys is not None:
            keys.client(self.sock)
        self.sock.connect(address)

    def publish(self, topic: str, msg: Message) -> None:
        self.sock.send_multipart(protocol.topic_frames(topic, msg), copy=False)

    def close(self) -> None:
        self.sock.close()


class SignalSubscriber:
    """SUB socket on the bus's XPUB side; `recv(timeout)` -> (topic, Envelope) or None."""

    def __init__(self, address: str, topics: tuple[str, ...] = ("weights", "control"),
                 ctx: zmq.Context | None = None, max_frame_bytes: int = protocol.DEFAULT_MAX_FRAME_BYTES,
                 keys: Keyring | None = None):
        self.ctx = ctx or zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        if keys is not None:
            keys.client(self.sock)
        self.sock.setsockopt(zmq.RCVHWM, 100_000)
        for t in topics:
            self.sock.setsockopt(zmq.SUBSCRIBE, t.encode())
        self.sock.connect(address)
        self.max_frame_bytes = max_frame_bytes

    def recv(self, timeout: float = 0.0) -> tuple[str, protocol.Envelope] | None:
        if not self.sock.poll(int(timeout * 1000), zmq.POLLIN):
            return None
        return protocol.decode_topic(self.sock.recv_multipart(copy=False), self.max_frame_bytes)

    def close(self) -> None:
        self.sock.close(0)
