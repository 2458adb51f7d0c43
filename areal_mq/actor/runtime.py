"""The worker runtime every role shares: sockets in an I/O thread, signals, graceful drain.

Core, not a role: roles (workers/*) build on it; it imports no role. The role's hooks are driven on top of it
by the role loop (areal_mq/actor/roles.py); the link to the job broker (READY, heartbeats, reconnect,
DISCONNECT) is areal_mq/actor/link.py's WorkerLink, which this runtime drives once and the swarm N times.

What: `WorkerRuntime` owns the worker's sockets in a background I/O thread (the WorkerLink's DEALER to the job
broker, a SUB to the signal bus). The role's own thread sees only typed objects:

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
liveness measures the process, not the length of its work items. The link is single-threaded, so only the
I/O thread touches it: the role thread's READY, replies and DISCONNECT go through an outbox of link calls,
each kept until the link takes it (no connection now: the next round). When the link reconnects, the bus
subscription is renewed with it, and the jobs in flight are forgotten (the new broker does not know them).
A worker with no service (controller, trainer) has no link: only the bus.
"""
from __future__ import annotations

import os
import queue
import signal
import socket
import threading
import time
from typing import Any, Callable, Iterable

import zmq

from areal_mq import protocol
from areal_mq.actor.link import Job, WorkerLink, advertised_tasks, pending_frames
from areal_mq.errors import ProtocolError
from areal_mq.messages import Control, Error, Message, WeightsReady
from areal_mq.security import Keyring, warn_if_insecure
from areal_mq.telemetry.log import make_logger


def default_worker_id(role: str) -> str:
    return f"{role}-{socket.gethostname()}-{os.getpid()}"


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
        self.heartbeat_s = cfg.brokers.heartbeat_s
        self.max_frame_bytes = int(cfg.brokers.max_frame_mb * 1024 * 1024)
        self.jobs: queue.Queue[Job] = queue.Queue()
        self.signals: queue.Queue[protocol.Envelope] = queue.Queue()
        self._outbox: queue.Queue[Callable[[WorkerLink], bool]] = queue.Queue()
        self._in_flight: set[str] = set()
        self._lock = threading.Lock()
        self._stop_io = threading.Event()
        self._stopping = threading.Event()
        self._announced = False
        self._weights_key: tuple | None = None
        self._ctx = zmq.Context()
        # the link is the I/O thread's alone (it opens the socket there); the role thread posts to the outbox
        self.link = None if service is None else WorkerLink(
            self._ctx, cfg.brokers, self.keys, self.worker_id, role=role, service=service, capacity=capacity,
            tasks=self.tasks, log=log, on_rejoin=self._forget_in_flight)
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
            capacity, tasks = self.capacity, self.tasks
            self._post(lambda link: link.ready(capacity, tasks))

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
        frames = protocol.encode(msg, reply_to=job.id)
        self._post(lambda link: link.send(frames))

    def partial(self, job: Job, msg: Message) -> None:
        """Send a view of `job` while it runs (a GeneratePartial): the job stays in flight; reply() still ends it."""
        frames = protocol.encode(msg, reply_to=job.id)
        self._post(lambda link: link.send(frames))

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
            self._announced = False
            reason = "drained" if not self.in_flight else "drain timeout"
            self._post(lambda link: link.disconnect(reason))  # the link sends no READY after it
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
        return self.link.reconnects if self.link is not None else 0

    # ------------------------------------------------------------ I/O thread
    def _post(self, call: Callable[[WorkerLink], bool]) -> None:
        """Queue a link call for the I/O thread (it returns False when no connection took it: kept, retried)."""
        self._outbox.put(call)
        self._wake()

    def _wake(self) -> None:
        with self._lock:
            try:
                self._wake_tx.send(b"", zmq.NOBLOCK)
            except zmq.ZMQError:
                pass

    def _forget_in_flight(self) -> None:
        with self._lock:
            self._in_flight.clear()

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
        if self.link is not None:
            self.link.open()
        self._sub = self._subscribe()
        try:
            self._run()
        finally:
            if self.link is not None:
                self.link.close()
            if self._sub is not None:
                self._sub.close(0)

    def _run(self) -> None:
        poller = zmq.Poller()
        link = self.link
        for s in (link and link.sock, self._sub, self._wake_rx):
            if s is not None:
                poller.register(s, zmq.POLLIN)
        while not self._stop_io.is_set():
            events = dict(poller.poll(int(self.heartbeat_s * 250)))
            if self._wake_rx in events:
                while self._wake_rx.poll(0):
                    self._wake_rx.recv()
            if link is not None:
                self._flush_outbox(link)
                if link.sock in events:
                    self._take_jobs(link)
            elif not self._outbox.empty():
                self._outbox = queue.Queue()
            if self._sub is not None and self._sub in events:
                self._drain_sub(self._sub)
            if link is None:
                continue
            old = link.sock
            if link.beat(time.monotonic()):
                poller.unregister(old)
                poller.register(link.sock, zmq.POLLIN)
                self._resubscribe(poller)

    def _resubscribe(self, poller: zmq.Poller) -> None:
        """The job broker link was replaced: the bus link went down with it (same host, same network). A fresh
        subscription is replayed the retained WeightsReady at once, instead of waiting for TCP to notice."""
        if self._sub is not None:
            poller.unregister(self._sub)
            self._sub.close(0)
        self._sub = self._subscribe()
        if self._sub is not None:
            poller.register(self._sub, zmq.POLLIN)

    def _flush_outbox(self, link: WorkerLink) -> None:
        while True:
            try:
                call = self._outbox.queue[0]  # peek: only a call the link took leaves the outbox
            except IndexError:
                return
            if not call(link):
                return  # no connection now (broker down or refusing us): keep it for the next round
            self._outbox.get_nowait()

    def _take_jobs(self, link: WorkerLink) -> None:
        for job in link.receive():
            with self._lock:
                self._in_flight.add(job.id)
            self.jobs.put(job)

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
