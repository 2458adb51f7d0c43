"""The worker runtime every role shares: connect, READY, heartbeats, reconnect, signals, graceful drain.

Core, not a role: roles (workers/*) build on it; it imports no role. Two parts: `WorkerRuntime` (the sockets,
below) and `RoleLoop` (drives a role's hooks on top of it, at the end of this file).

What: `WorkerRuntime` owns the worker's sockets in a background I/O thread (DEALER to the job broker, SUB
to the signal bus). The role's own thread sees only typed objects:

    rt = WorkerRuntime(cfg, role="reward", service="reward", capacity=4)
    initial = rt.start()            # connect + subscribe; returns the retained WeightsReady (late joiners)
    ... load `initial` if the role cares about weights ...
    rt.ready()                      # READY(service, capacity, tasks): jobs start flowing
    while not rt.stopping:
        job = rt.next_job(timeout=0.1)          # Job(id, msg) | None
        sig = rt.next_signal()                  # Envelope(WeightsReady | Control) | None
        rt.reply(job, result) / rt.fail(job, code, message)     # thread-safe
    rt.close()                      # drain: READY(0), wait for in-flight, DISCONNECT (broker requeues rest)

Why an I/O thread: heartbeats keep flowing while the role computes (a decoding step, a weight load), so
liveness measures the process, not the length of its work items. Liveness (Paranoid Pirate): the broker
answers every heartbeat; silence for `liveness` intervals means the broker is gone, and the runtime
reconnects with exponential backoff (doubling from `heartbeat_s`, capped at `reconnect_max_s`, jittered) and
sends READY again. The liveness rule is client.Liveness, the same object JobClient uses. `tasks` (READY)
tells the broker which reward tasks this worker scores, so it is sent only jobs it can serve; none (or a '*')
means any job of its service.

The role loop: one for every role; the role writes hooks, the loop and its middleware do the rest. A role (workers/rollout.py, reward.py, trainer.py, controller.py, echo.py) subclasses `Role` and fills in
the hooks it needs; `RoleLoop(runtime, role).run()` drives them from one thread:

    while not role.should_stop(runtime.stopping):
        each signal  ──► middleware.signal ──► role.on_signal(msg)   (WeightsReady, Control)
        role.on_tick() ─────────────────────────────────────────────► True = it did work, do not wait
        each job     ──► role.on_job(job)                             (the runtime's Job: id + typed message)
        middleware.tick
    drain: READY(0); role.on_tick() while role.busy() (until role.drain_timeout_s); role.on_stop()

Cross-cutting concerns are middleware, written once:
- `PauseControl`: Control(pause|resume) for this role (or for every role) sets `role.paused` and, for a role
  with a broker service, announces READY(0) / READY(capacity) so the broker sends nothing new meanwhile, and
  calls role.on_pause(paused). What a paused role stops doing itself is its own: the rollout worker pauses its
  engine (Engine.pause: in-flight sequences keep their state; vLLM stops generating in the background too), the
  trainer takes no batch, the controller admits no prompt (answers are still collected).
- `StatsReport`: every `every_s`, `role.stats()` as one `{role}.stats` event.
- drain on SIGTERM / Control(shutdown): the runtime sets `stopping`; the loop drains as above, then the
  caller closes the runtime (DISCONNECT: the broker requeues whatever was not answered).
The runtime may be None (a trainer rank other than 0 under `accelerate launch`: no sockets, no signals).
"""
from __future__ import annotations

import os
import queue
import signal
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator

import zmq

from areal_mq import protocol
from areal_mq.client import Liveness, send
from areal_mq.errors import ProtocolError
from areal_mq.telemetry.log import make_logger
from areal_mq.messages import (MAX_READY_TASKS, Control, Disconnect, Error, Heartbeat, Kind, Message, Ready,
                               WeightsReady)
from areal_mq.security import Keyring, warn_if_insecure


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


@dataclass
class Job:
    id: str
    msg: Message
    received_at: float = field(default_factory=time.monotonic)


def default_worker_id(role: str) -> str:
    return f"{role}-{socket.gethostname()}-{os.getpid()}"


def worker_dealer(ctx: zmq.Context, keys: Any, address: str) -> zmq.Socket:
    """A worker's DEALER to the job broker: no HWM either way (credits bound what is in flight), linger 0."""
    dealer = keys.client(ctx.socket(zmq.DEALER))
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.setsockopt(zmq.SNDHWM, 0)
    dealer.setsockopt(zmq.RCVHWM, 0)
    dealer.connect(address)
    return dealer


class WorkerRuntime:
    def __init__(self, cfg: Any, role: str, service: str | None, capacity: int, worker_id: str | None = None,
                 topics: tuple[str, ...] = ("weights", "control"), log: Any = None, install_signals: bool = True,
                 keys: Keyring | None = None, tasks: Iterable[str] = ()):
        self.cfg, self.role, self.service, self.capacity = cfg, role, service, capacity
        self.tasks = advertised_tasks(tasks)
        self.worker_id = worker_id or default_worker_id(role)
        self.topics = topics
        self.keys = keys or Keyring.from_config(cfg, role)
        self._sink = None
        if log is None:
            log, self._sink = make_logger(cfg, role, self.worker_id, keys=self.keys)
        self.log = log
        warn_if_insecure(self.keys, log)
        b = cfg.brokers
        self.heartbeat_s, self.liveness = b.heartbeat_s, b.liveness
        self.link = Liveness(b.heartbeat_s, b.liveness, b.reconnect_max_s)
        self.max_frame_bytes = int(b.max_frame_mb * 1024 * 1024)
        self.jobs: queue.Queue[Job] = queue.Queue()
        self.signals: queue.Queue[protocol.Envelope] = queue.Queue()
        self._outbox: queue.Queue[list] = queue.Queue()
        self._in_flight: set[str] = set()
        self._lock = threading.Lock()
        self._stop_io = threading.Event()
        self._stopping = threading.Event()
        self._announced = False
        self._weights_key: tuple | None = None
        self._ctx = zmq.Context()
        self._wake_addr = f"inproc://wake-{id(self)}"
        self._wake_rx = self._ctx.socket(zmq.PULL)
        self._wake_rx.bind(self._wake_addr)
        self._wake_tx = self._ctx.socket(zmq.PUSH)
        self._wake_tx.setsockopt(zmq.LINGER, 0)
        self._wake_tx.connect(self._wake_addr)
        self._thread: threading.Thread | None = None
        if install_signals and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, lambda *_: self.request_stop("sigterm"))

    # ------------------------------------------------------------ role-facing API
    @property
    def stopping(self) -> bool:
        return self._stopping.is_set()

    def request_stop(self, reason: str) -> None:
        if not self._stopping.is_set():
            self.log.info(f"{self.role}.stopping", reason=reason)
        self._stopping.set()

    def start(self, wait_weights_s: float = 10.0) -> WeightsReady | None:
        """Start the I/O thread; if subscribed to weights, wait for the bus's retained WeightsReady."""
        self._thread = threading.Thread(target=self._io_loop, name=f"{self.role}-io", daemon=True)
        self._thread.start()
        if "weights" not in self.topics:
            return None
        deadline = time.monotonic() + wait_weights_s
        while time.monotonic() < deadline:
            try:
                env = self.signals.get(timeout=0.1)
            except queue.Empty:
                continue
            if isinstance(env.msg, WeightsReady):
                return env.msg
            self.signals.put(env)
        self.log.warning(f"{self.role}.no_retained_weights", waited_s=wait_weights_s,
                         hint="signal bus unreachable? starting from the base model")
        return None

    def ready(self, capacity: int | None = None, tasks: Iterable[str] | None = None) -> None:
        """Announce (again) to the job broker; capacity 0 means 'send me nothing new'. `tasks`: the reward
        tasks served from now on (None: unchanged; empty or containing '*': any)."""
        if capacity is not None:
            self.capacity = capacity
        if tasks is not None:
            self.tasks = advertised_tasks(tasks)
        self._announced = self.service is not None
        if self._announced:
            self._send(protocol.encode(self._ready_msg()))

    def next_job(self, timeout: float = 0.0) -> Job | None:
        try:
            return self.jobs.get(timeout=timeout) if timeout > 0 else self.jobs.get_nowait()
        except queue.Empty:
            return None

    def next_signal(self, timeout: float = 0.0) -> protocol.Envelope | None:
        try:
            return self.signals.get(timeout=timeout) if timeout > 0 else self.signals.get_nowait()
        except queue.Empty:
            return None

    def reply(self, job: Job, msg: Message) -> None:
        with self._lock:
            self._in_flight.discard(job.id)
        self._send(protocol.encode(msg, reply_to=job.id))

    def fail(self, job: Job, code: str, message: str) -> None:
        self.log.warning(f"{self.role}.job_failed", job=job.id, code=code, error=message)
        self.reply(job, Error(code=code, message=message, ref_id=job.id))

    @property
    def in_flight(self) -> int:
        with self._lock:
            return len(self._in_flight)

    def close(self, drain_timeout: float = 30.0) -> None:
        """Graceful drain: stop taking jobs, wait for in-flight ones, then DISCONNECT (the rest is requeued)."""
        if self._thread is None:
            return
        if self._announced:
            self.ready(0)
            deadline = time.monotonic() + drain_timeout
            while self.in_flight and time.monotonic() < deadline:
                time.sleep(0.05)
            self._announced = False  # no re-announcing READY after DISCONNECT
            self._send(protocol.encode(Disconnect(reason="drained" if not self.in_flight else "drain timeout")))
        time.sleep(0.05)
        self._stop_io.set()
        self._wake()
        self._thread.join(5)
        self._thread = None
        self._wake_tx.close(0)
        self._wake_rx.close(0)
        self._ctx.term()
        self.log.info(f"{self.role}.closed", reconnects=self.reconnects)
        if self._sink is not None:
            self._sink.close()

    @property
    def reconnects(self) -> int:
        return self.link.reconnects

    # ------------------------------------------------------------ I/O thread
    def _ready_msg(self) -> Ready:
        return Ready(service=self.service or "-", capacity=self.capacity, worker_id=self.worker_id, role=self.role,
                     tasks=self.tasks)

    def _send(self, frames: list) -> None:
        self._outbox.put(frames)
        self._wake()

    def _wake(self) -> None:
        with self._lock:
            try:
                self._wake_tx.send(b"", zmq.NOBLOCK)
            except zmq.ZMQError:
                pass

    def _connect(self) -> zmq.Socket:
        return worker_dealer(self._ctx, self.keys, self.cfg.brokers.job_addr)

    def _subscribe(self) -> zmq.Socket | None:
        if not self.topics:
            return None
        sub = self.keys.client(self._ctx.socket(zmq.SUB))
        sub.setsockopt(zmq.LINGER, 0)
        for t in self.topics:
            sub.setsockopt(zmq.SUBSCRIBE, t.encode())
        sub.connect(self.cfg.brokers.bus_out_addr)
        return sub

    def _io_loop(self) -> None:
        self._socks = {"dealer": self._connect() if self.service else None, "sub": self._subscribe()}
        try:
            self._run()
        finally:
            for s in self._socks.values():
                if s is not None:
                    s.close(0)

    def _reopen(self, poller: zmq.Poller, name: str, make: Any) -> zmq.Socket | None:
        """Replace socket `name` by a fresh one (a new TCP connection and identity)."""
        old = self._socks[name]
        if old is not None:
            poller.unregister(old)
            old.close(0)
        new = self._socks[name] = make()
        if new is not None:
            poller.register(new, zmq.POLLIN)
        return new

    def _run(self) -> None:
        poller = zmq.Poller()
        dealer, sub = self._socks["dealer"], self._socks["sub"]
        for s in (dealer, sub, self._wake_rx):
            if s is not None:
                poller.register(s, zmq.POLLIN)
        beats = 0
        link = self.link
        while not self._stop_io.is_set():
            events = dict(poller.poll(int(self.heartbeat_s * 250)))
            if self._wake_rx in events:
                while self._wake_rx.poll(0):
                    self._wake_rx.recv()
            if dealer is not None:
                self._flush_outbox(dealer)
                if dealer in events:
                    self._drain_dealer(dealer)
            elif not self._outbox.empty():
                self._outbox = queue.Queue()
            if sub is not None and sub in events:
                self._drain_sub(sub)
            now = time.monotonic()
            if dealer is None:
                continue
            if link.beat_due(now):
                beats += 1
                send(dealer, protocol.encode(Heartbeat(peer_id=self.worker_id)))
                if self._announced and beats % self.liveness == 0 and link.silent_s(now) < 2 * self.heartbeat_s:
                    # Re-announce once per liveness window: a broker restarted faster than that (our socket
                    # reconnected silently) or one that dropped us during a stall answers heartbeats from
                    # anyone, so without this it would never learn about us again. Harmless when registered.
                    # Only while the broker answers: a READY queued on a dead link is delivered when the link
                    # heals, after we replaced the socket, and would register a ghost with the old identity.
                    send(dealer, protocol.encode(self._ready_msg()))
            if link.lost(now):
                silent = link.silent_s(now)
                dealer = self._reopen(poller, "dealer", self._connect)
                # the bus link went down with it (same host, same network): a fresh subscription is replayed
                # the retained WeightsReady at once, instead of waiting for TCP to notice the old one is dead
                sub = self._reopen(poller, "sub", self._subscribe)
                base, delay = link.reconnected()
                self.log.warning(f"{self.role}.broker_lost", silent_s=round(silent, 1),
                                 retry_in_s=round(delay, 2), backoff_s=round(base, 2))
                self._rejoin(dealer)

    def _rejoin(self, dealer: zmq.Socket) -> None:
        """A new broker connection (a reconnect, or a broker that restarted): it knows neither us nor the old
        broker's jobs, which their clients resubmit. Forget them and announce ourselves at once."""
        with self._lock:
            self._in_flight.clear()
        if self._announced:
            send(dealer, protocol.encode(self._ready_msg()))

    def _flush_outbox(self, dealer: zmq.Socket) -> None:
        while True:
            try:
                frames = self._outbox.queue[0]  # peek: only a sent message leaves the outbox
            except IndexError:
                return
            if not send(dealer, frames):
                return  # no connection now (broker down or refusing us): keep it for the next round
            self._outbox.get_nowait()

    def _drain_dealer(self, dealer: zmq.Socket) -> None:
        for frames in pending_frames(dealer):
            self.link.heard()
            try:
                env = protocol.decode(frames, self.max_frame_bytes)
            except ProtocolError as exc:
                self.log.warning(f"{self.role}.bad_job", code=exc.code, error=str(exc))
                if exc.msg_id:  # answer it so the client is not left waiting
                    send(dealer, protocol.error_reply(exc))
                continue
            if env.kind == Kind.HEARTBEAT:
                if self.link.restarted(env.msg.peer_id):
                    self.log.warning(f"{self.role}.broker_restarted", broker=env.msg.peer_id)
                    self._rejoin(dealer)
                continue
            if env.kind == Kind.ERROR:
                self.log.warning(f"{self.role}.broker_error", code=env.msg.code, error=env.msg.message)
                continue
            with self._lock:
                self._in_flight.add(env.id)
            self.jobs.put(Job(env.id, env.msg))

    def _drain_sub(self, sub: zmq.Socket) -> None:
        for frames in pending_frames(sub):
            try:
                topic, env = protocol.decode_topic(frames, self.max_frame_bytes)
            except ProtocolError as exc:
                self.log.warning(f"{self.role}.bad_signal", code=exc.code, error=str(exc))
                continue
            if isinstance(env.msg, WeightsReady):
                key = (env.msg.version, env.msg.path, env.msg.endpoint)
                if key == self._weights_key:
                    continue  # the bus replays the retained version to every new subscriber
                self._weights_key = key  # a lower version is real: a trainer resumed from a checkpoint
            if isinstance(env.msg, Control) and env.msg.action == "shutdown" and \
                    env.msg.target_role in ("", self.role):
                self.request_stop(f"control: {env.msg.reason}")
            self.signals.put(env)


# ---------------------------------------------------------------- the role loop
class Role:
    """Hooks a role overrides; every one runs on the loop's thread. `rt` is the WorkerRuntime (or None)."""

    name = "role"
    drain_timeout_s = 0.0  # how long the loop keeps ticking a busy role after a stop request
    idle_wait_s = 0.05  # how long the loop waits for a job when on_tick did nothing
    stats_every_s = 5.0  # `{name}.stats` (and metrics sinks) period; 0: the role reports otherwise

    def __init__(self, rt: Any):
        self.rt = rt
        self.log = rt.log if rt is not None else None
        self.paused = False

    def on_job(self, job: Any) -> None:
        self.rt.fail(job, "bad_request", f"{self.name} workers take no jobs, got {job.msg.kind.value}")

    def on_signal(self, msg: Any) -> None:
        """A WeightsReady or Control from the bus (pause/resume/shutdown are already handled by the loop)."""

    def on_tick(self) -> bool:
        """Advance own work (an engine step, a train step, admission). True when it did something."""
        return False

    def busy(self) -> bool:
        """Work in flight that a drain should let finish."""
        return False

    def should_stop(self, stopping: bool) -> bool:
        """End the loop? `stopping`: SIGTERM or Control(shutdown) reached this process."""
        return stopping

    def on_stop(self) -> None:
        """After the drain (abort what is left, final checkpoint, final stats)."""

    def on_pause(self, paused: bool) -> None:
        """Control(pause) / Control(resume) changed `self.paused` (already set when this is called)."""

    def stats(self) -> dict:
        return {}

    @property
    def capacity(self) -> int:
        return self.rt.capacity if self.rt is not None else 0


class PauseControl:
    """Control(pause|resume) -> role.paused, and READY(0) / READY(capacity) for a role the broker sends jobs."""

    def __init__(self) -> None:
        self.capacity = 0

    def signal(self, loop: "RoleLoop", msg: Any) -> None:
        role, rt = loop.role, loop.rt
        if not isinstance(msg, Control) or msg.action not in ("pause", "resume") or \
                msg.target_role not in ("", role.name):
            return
        pause = msg.action == "pause"
        if pause == role.paused:
            return
        role.paused = pause
        role.on_pause(pause)
        if rt is not None and rt.service is not None:
            if pause:
                self.capacity = rt.capacity
            rt.ready(0 if pause else self.capacity)
        if role.log is not None:
            role.log.info(f"{role.name}.control", action=msg.action, reason=msg.reason)

    def tick(self, loop: "RoleLoop") -> None:
        pass


class StatsReport:
    """`{role}.stats` every `every_s` seconds from role.stats() (numbers only: the dashboards plot them), and
    the same numbers to the metrics sinks (areal_mq/telemetry/metrics.py) when `sinks` is given: TensorBoard / W&B
    curves of every role, not only the trainer's, stepped by the report's number."""

    def __init__(self, every_s: float = 5.0, sinks: Any = None):
        self.every_s, self.sinks = every_s, sinks
        self.last = time.monotonic()
        self.reports = 0

    def signal(self, loop: "RoleLoop", msg: Any) -> None:
        pass

    def tick(self, loop: "RoleLoop") -> None:
        now = time.monotonic()
        if now - self.last < self.every_s or loop.role.log is None:
            return
        self.last = now
        stats = loop.role.stats()
        if stats:
            loop.role.log.info(f"{loop.role.name}.stats", **stats)
            if self.sinks is not None:
                self.sinks.write(self.reports, stats)
                self.reports += 1

    def close(self) -> None:
        if self.sinks is not None:
            self.sinks.close()


def stats_sinks(cfg: Any, role: str, log: Any) -> Any:
    """Metrics sinks for a role's periodic stats when the config asks for TensorBoard or W&B (else None: the
    `{role}.stats` events already carry them)."""
    metrics = getattr(cfg, "metrics", None)
    if metrics is None or not (metrics.tensorboard or metrics.wandb):
        return None
    from areal_mq.telemetry.metrics import MetricsSinks

    return MetricsSinks.from_config(cfg, role, log)


class RoleLoop:
    def __init__(self, rt: Any, role: Role, middleware: Iterable[Any] | None = None):
        self.rt, self.role = rt, role
        if middleware is None:
            sinks = stats_sinks(getattr(rt, "cfg", None), role.name, role.log) if role.stats_every_s else None
            middleware = [PauseControl(), StatsReport(role.stats_every_s or 5.0, sinks)]
        self.middleware = list(middleware)

    def run(self) -> None:
        role = self.role
        while not role.should_stop(self.rt is not None and self.rt.stopping):
            self.round(accept=True)
        if self.rt is not None and self.rt.service is not None:
            self.rt.ready(0)  # drain: nothing new, finish what runs
        deadline = time.monotonic() + role.drain_timeout_s
        while role.busy() and time.monotonic() < deadline:
            self.round(accept=False)
        role.on_stop()
        for m in self.middleware:
            getattr(m, "close", lambda: None)()

    def round(self, accept: bool) -> None:
        role, rt = self.role, self.rt
        if rt is not None:
            while (env := rt.next_signal()) is not None:
                for m in self.middleware:
                    m.signal(self, env.msg)
                role.on_signal(env.msg)
        did = role.on_tick()
        if rt is not None and accept and rt.service is not None:
            job = rt.next_job(timeout=0.0 if did else role.idle_wait_s)
            while job is not None:
                role.on_job(job)
                job = rt.next_job()
        elif not did:
            time.sleep(role.idle_wait_s if accept else 0.01)
        for m in self.middleware:
            m.tick(self)
