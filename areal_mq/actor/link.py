"""One worker's link to the job broker: READY, heartbeats, READY again, reconnect, DISCONNECT (Paranoid Pirate).

What: `WorkerLink` owns one DEALER to the job broker and the liveness state machine of one worker. It is
single-threaded and never blocks: the thread that owns it polls `link.sock` and calls it. The worker runtime
(areal_mq/actor/runtime.py) drives one from its I/O thread; the swarm (workers/swarm.py) drives N from its one
loop, so the broker sees N independent workers that cost one process.
Why one class: the state machine below is subtle (a READY queued on a dead link registers a ghost; a broker
restarted faster than the liveness window never looks silent) and was written twice; now both drivers share
every fix.

    link = WorkerLink(ctx, cfg.brokers, keys, worker_id, role="reward", service="reward", capacity=4, log=log)
    link.open()                      # a DEALER (client.connect_dealer); register link.sock in your poller
    link.ready()                     # READY(service, capacity, tasks): announced, jobs start flowing
    loop:
        for job in link.receive():   # when link.sock is readable; heartbeat answers, broker errors handled here
            ... link.reply(job, msg) / link.fail(job, code, message)
        if link.beat(time.monotonic()):   # call often (a few times per heartbeat_s)
            ... the socket was replaced: register the new link.sock
    link.disconnect("drained"); link.close()

The state machine (intervals from the `brokers` config section):

    opened ──ready()──► announced ──disconnect()──► silent (no READY is ever sent after DISCONNECT)
    every heartbeat_s            HEARTBEAT; while announced and the broker answers, READY again once per
                                 `liveness` beats (a broker that dropped us, or restarted unseen, learns of us)
    any frame received           heard: the outage (if any) is over, the backoff starts from the shortest
    silent > liveness * heartbeat_s + backoff
                                 lost: a new socket (new identity), the backoff doubles (client.Liveness), rejoin
    heartbeat answer, new boot id
                                 the broker restarted: rejoin
    rejoin                       on_rejoin() (the new broker knows none of the old jobs; their clients resubmit
                                 them), then READY at once if announced

`tasks` (READY) tells the broker which reward tasks this worker scores, so it is sent only jobs it can serve;
none (or a '*') means any job of its service. Log events: `{role}.job_failed` (the role's), and the link's own
`{event_prefix}.broker_lost|broker_restarted|bad_job|broker_error` (the prefix is the role unless given).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator

import zmq

from areal_mq import protocol
from areal_mq.client import Liveness, connect_dealer, send
from areal_mq.errors import ProtocolError
from areal_mq.messages import MAX_READY_TASKS, Disconnect, Error, Heartbeat, Kind, Message, Ready


@dataclass
class Job:
    """A job the broker sent this worker: its id (the reply goes to it) and the typed request."""
    id: str
    msg: Message
    received_at: float = field(default_factory=time.monotonic)


def advertised_tasks(tasks: Iterable[str]) -> list[str]:
    """The READY `tasks` for what a worker serves: sorted names; [] (anything) for a '*', or for names READY
    cannot carry (too many, or one over 128 characters): such a worker gets every job of its service."""
    names = sorted({str(t) for t in tasks if t})
    too_big = len(names) > MAX_READY_TASKS or any(len(n) > 128 for n in names)
    return [] if "*" in names or too_big else names


def pending_frames(sock: zmq.Socket) -> Iterator[list]:
    """Every message waiting on `sock` now, without blocking."""
    while True:
        try:
            yield sock.recv_multipart(zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return


class WorkerLink:
    """One worker's DEALER to the job broker and its liveness (see the module docstring). Not thread-safe.
    `brokers`: the config's brokers section (job_addr, heartbeat_s, liveness, reconnect_max_s, max_frame_mb;
    validated there)."""

    def __init__(self, ctx: zmq.Context, brokers: Any, keys: Any, worker_id: str, *, role: str, service: str,
                 capacity: int, tasks: Iterable[str] = (), log: Any, event_prefix: str | None = None,
                 on_rejoin: Callable[[], None] | None = None):
        self.ctx, self.address, self.keys, self.worker_id = ctx, brokers.job_addr, keys, worker_id
        self.role, self.service, self.capacity = role, service, capacity
        self.tasks = advertised_tasks(tasks)
        self.log, self.events, self.on_rejoin = log, event_prefix or role, on_rejoin
        self.heartbeat_s, self.beats_per_window = brokers.heartbeat_s, brokers.liveness
        self.liveness = Liveness(brokers.heartbeat_s, brokers.liveness, brokers.reconnect_max_s)
        self.max_frame_bytes = int(brokers.max_frame_mb * (1 << 20))
        self.announced = False
        self.beats = 0
        self.sock: zmq.Socket | None = None

    @property
    def reconnects(self) -> int:
        return self.liveness.reconnects

    def open(self) -> zmq.Socket:
        """Connect (a fresh DEALER: a new TCP connection and identity); the link must be closed or new."""
        if self.sock is not None:
            raise RuntimeError(f"link {self.worker_id} is already open: close() it first")
        self.sock = connect_dealer(self.ctx, self.address, self.keys)
        return self.sock

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close(0)
            self.sock = None

    # ------------------------------------------------------------ what a role sees
    def send(self, frames: list) -> bool:
        """Send without blocking; False when no connection takes it now (see client.send)."""
        if self.sock is None:
            raise RuntimeError(f"link {self.worker_id} is not open: call open() first")
        return send(self.sock, frames)

    def ready(self, capacity: int | None = None, tasks: Iterable[str] | None = None) -> bool:
        """Announce (again); capacity 0 means 'send me nothing new'. `tasks`: served from now on (None: unchanged)."""
        if capacity is not None:
            self.capacity = capacity
        if tasks is not None:
            self.tasks = advertised_tasks(tasks)
        self.announced = True
        return self.send(protocol.encode(self.ready_msg()))

    def ready_msg(self) -> Ready:
        return Ready(service=self.service, capacity=self.capacity, worker_id=self.worker_id, role=self.role,
                     tasks=self.tasks)

    def reply(self, job: Job, msg: Message) -> bool:
        return self.send(protocol.encode(msg, reply_to=job.id))

    def fail(self, job: Job, code: str, message: str) -> bool:
        self.log.warning(f"{self.role}.job_failed", job=job.id, code=code, error=message)
        return self.reply(job, Error(code=code, message=message, ref_id=job.id))

    def disconnect(self, reason: str) -> bool:
        """DISCONNECT (the broker requeues what we held); never READY again after it, not even on a rejoin."""
        self.announced = False
        try:
            return self.send(protocol.encode(Disconnect(reason=reason)))
        except zmq.ZMQError:  # a socket a failed reconnect left closed: the broker drops us by liveness
            return False

    # ------------------------------------------------------------ driven by the owner's loop
    def receive(self) -> list[Job]:
        """Every job waiting on the socket now; heartbeat answers, broker errors and bad frames handled here."""
        jobs = []
        for frames in pending_frames(self.sock):
            self.liveness.heard()
            try:
                env = protocol.decode(frames, self.max_frame_bytes)
            except ProtocolError as exc:
                self.log.warning(f"{self.events}.bad_job", code=exc.code, error=str(exc))
                if exc.msg_id:  # answer it so the client is not left waiting
                    self.send(protocol.error_reply(exc))
                continue
            if env.kind == Kind.HEARTBEAT:
                if self.liveness.restarted(env.msg.peer_id):
                    self.log.warning(f"{self.events}.broker_restarted", broker=env.msg.peer_id)
                    self._rejoin()
            elif env.kind == Kind.ERROR:
                self.log.warning(f"{self.events}.broker_error", code=env.msg.code, error=env.msg.message)
            else:
                jobs.append(Job(env.id, env.msg))
        return jobs

    def beat(self, now: float) -> bool:
        """Heartbeat when due; a silent broker gets a fresh socket and READY. True when the socket was replaced."""
        link = self.liveness
        if link.beat_due(now):
            self.beats += 1
            self.send(protocol.encode(Heartbeat(peer_id=self.worker_id)))
            if self.announced and self.beats % self.beats_per_window == 0 and \
                    link.silent_s(now) < 2 * self.heartbeat_s:
                # Re-announce once per liveness window: a broker restarted faster than that (our socket
                # reconnected silently) or one that dropped us during a stall answers heartbeats from
                # anyone, so without this it would never learn about us again. Harmless when registered.
                # Only while the broker answers: a READY queued on a dead link is delivered when the link
                # heals, after we replaced the socket, and would register a ghost with the old identity.
                self.send(protocol.encode(self.ready_msg()))
        if not link.lost(now):
            return False
        silent = link.silent_s(now)
        self.close()
        self.open()
        base, delay = link.reconnected()
        self.log.warning(f"{self.events}.broker_lost", silent_s=round(silent, 1), retry_in_s=round(delay, 2),
                         backoff_s=round(base, 2))
        self._rejoin()
        return True

    def _rejoin(self) -> None:
        """A new broker connection (a reconnect, or a broker that restarted): it knows neither us nor the old
        broker's jobs, which their clients resubmit. Forget them and announce ourselves at once."""
        if self.on_rejoin is not None:
            self.on_rejoin()
        if self.announced:
            self.send(protocol.encode(self.ready_msg()))
