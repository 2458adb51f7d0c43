"""Structured events: structlog JSON events named `component.event`, to file, bus and terminal.

What: `make_logger(cfg, role, worker_id)` returns a structlog logger bound with run id, role and worker id.
Every event is written as one JSON line to `run_dir/events/<role>-<worker_id>.jsonl`, published on the
signal bus topic "events" (by a background thread owning its own PUB socket, so logging is thread-safe
and never blocks on the network), and printed to stderr (pretty on a terminal, or JSON).
Why: one stream of facts from every process, which `areal-mq events tail` filters live or from files.
No structlog global configuration is touched; each process/component gets its own logger object.
"""
from __future__ import annotations

import json
import os
import queue
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any, TextIO

import structlog

LEVELS = {"debug": 10, "info": 20, "warning": 30, "error": 40, "critical": 50}
_LEVEL_STYLE = {"debug": "\x1b[2m", "info": "\x1b[32m", "warning": "\x1b[33m", "error": "\x1b[31m", "critical": "\x1b[41m"}


def _json_default(value: Any) -> Any:
    if hasattr(value, "tolist"):
        return value.tolist()
    return str(value)


def to_json(record: dict) -> str:
    return json.dumps(record, default=_json_default, separators=(",", ":"))


def format_pretty(record: dict, color: bool = False) -> str:
    """One readable line: time level role/worker event key=value ..."""
    ts = record.get("ts", 0.0)
    clock = time.strftime("%H:%M:%S", time.localtime(ts)) + f".{int((ts % 1) * 1000):03d}"
    level = str(record.get("level", "info"))
    who = f"{record.get('role', '?')}/{record.get('worker_id', '?')}"
    skip = {"ts", "level", "role", "worker_id", "event", "run_id"}
    rest = " ".join(f"{k}={_short(v)}" for k, v in record.items() if k not in skip)
    lvl = f"{level:<7}"
    if color:
        lvl = f"{_LEVEL_STYLE.get(level, '')}{lvl}\x1b[0m"
        name = f"\x1b[1m{record.get('event', '')}\x1b[0m"
    else:
        name = str(record.get("event", ""))
    return f"{clock} {lvl} {who:<22} {name} {rest}".rstrip()


def _short(value: Any) -> str:
    text = value if isinstance(value, str) else to_json(value)
    return text if len(text) <= 200 else text[:197] + "..."


class BusPublisher:
    """Background thread with a PUB socket connected to the bus XSUB port; `put(record)` never blocks."""

    def __init__(self, address: str, max_pending: int = 10_000, keys: Any = None):
        self._queue: queue.Queue = queue.Queue(maxsize=max_pending)
        self._address = address
        self._keys = keys
        self._stop = threading.Event()
        self.dropped = 0
        self._thread = threading.Thread(target=self._run, name="event-publisher", daemon=True)
        self._thread.start()

    def put(self, record: dict) -> None:
        try:
            self._queue.put_nowait(record)
        except queue.Full:
            self.dropped += 1  # a stalled bus must never stall the worker

    def _run(self) -> None:
        import zmq

        from areal_mq import protocol
        from areal_mq.messages import Event

        ctx = zmq.Context.instance()
        sock = ctx.socket(zmq.PUB)
        sock.setsockopt(zmq.LINGER, 200)
        sock.setsockopt(zmq.SNDHWM, 10_000)
        if self._keys is not None:
            self._keys.client(sock)
        sock.connect(self._address)
        try:
            while not (self._stop.is_set() and self._queue.empty()):
                try:
                    record = self._queue.get(timeout=0.1)
                except queue.Empty:
                    continue
                try:
                    sock.send_multipart(protocol.topic_frames("events", Event(record=record)), zmq.NOBLOCK)
                except zmq.Again:
                    self.dropped += 1
        finally:
            sock.close()

    def close(self, timeout: float = 1.0) -> None:
        self._stop.set()
        self._thread.join(timeout)


MAX_BACKLOG_BYTES = 16 << 20  # an events file's unwritten lines kept while its disk is full (EventsFile)


class EventsFile:
    """A process's events file, written so that a full disk delays lines instead of losing or garbling them.

    Lines go to the file unbuffered (one os.write each). A write that fails (ENOSPC, EIO) or is cut short keeps
    what was not written, in order, in a backlog of at most `max_backlog` bytes, and the next line written first
    tries the backlog again: once space returns every line lands whole and in order (a partial line's rest
    follows it). Only lines beyond the backlog bound are dropped, counted in `dropped`. The soak of 2026-11-28 lost
    two `trainer.step` lines under a full disk (the old sink dropped them; Python's buffer also wrote a few of
    the "dropped" lines later, one of them cut in half), and its audit then saw two versions never trained."""

    def __init__(self, path: Path, max_backlog: int = MAX_BACKLOG_BYTES):
        self.fd: int | None = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self.max_backlog = max_backlog
        self.backlog = bytearray()  # unwritten bytes: whole lines, the first maybe the rest of a started one
        self.dropped = 0
        self.reason = ""

    def write(self, line: str) -> bool:
        """Queue one line and write what the disk takes; never raises. True once nothing is left behind."""
        data = (line + "\n").encode()
        if self.backlog:
            self.flush()  # space may be back: make room before judging the bound
        if len(self.backlog) + len(data) > self.max_backlog:
            self.dropped += 1
        else:
            self.backlog += data
        return self.flush()

    def flush(self) -> bool:
        while self.backlog and self.fd is not None:
            try:
                n = self._raw_write(self.backlog)
            except OSError as exc:
                self.reason = f"{type(exc).__name__}: {exc}"[:200]
                return False
            del self.backlog[:n]
        return not self.backlog

    def _raw_write(self, data: bytearray) -> int:
        return os.write(self.fd, data)

    def close(self) -> None:
        """Write what is left if the disk takes it now; what it does not take is lost with the process."""
        self.flush()
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


class EventSink:
    """The structlog processor at the end of the chain: fans an event out, then drops it."""

    def __init__(self, file_path: Path | None, publisher: BusPublisher | None, console: str, min_level: int,
                 stream: TextIO | None = None):
        self._file = EventsFile(file_path) if file_path else None
        self._publisher = publisher
        self._console = console
        self._min_level = min_level
        self._stream = stream or sys.stderr
        self._color = console == "pretty" and self._stream.isatty()
        self._lock = threading.Lock()
        # Lines the console could not take (a closed pipe, a full disk under a redirected stderr). A process must
        # not die because it cannot log: the line is dropped, counted, and once writing works again one
        # `events.lines_dropped` line says how many went and why (the soak's disk_full fault found processes
        # ending on ENOSPC from a log call). The events file keeps its lines back instead (EventsFile).
        self._dropped = 0
        self._drop_reason = ""

    def __call__(self, logger: Any, method: str, event_dict: dict) -> Any:
        level = "warning" if method == "warn" else ("error" if method == "exception" else method)
        if LEVELS.get(level, 20) < self._min_level:
            raise structlog.DropEvent
        record = {"ts": time.time(), "level": level, **event_dict}
        exc = record.pop("exc_info", None) or (method == "exception")
        if exc:
            info = sys.exc_info() if exc is True else exc
            if isinstance(info, BaseException):
                info = (type(info), info, info.__traceback__)
            if info and info[0] is not None:
                record["exception"] = "".join(traceback.format_exception(*info))
        line = to_json(record)
        with self._lock:
            if self._file:
                if self._file.write(line) and self._file.dropped:  # the backlog overflowed: say so once it drained
                    dropped, self._file.dropped = self._file.dropped, 0
                    self._file.write(to_json(self._note(record, dropped, "file", self._file.reason)))
            if self._console == "json":
                self._write(line, record)
            elif self._console == "pretty":
                self._write(format_pretty(record, self._color), record)
        if self._publisher:
            self._publisher.put(record)
        raise structlog.DropEvent

    @staticmethod
    def _note(record: dict, lines: int, where: str, reason: str) -> dict:
        return {"ts": time.time(), "level": "warning", **{k: record[k] for k in ("run_id", "role", "worker_id", "pid")
                if k in record}, "lines": lines, "to": where, "reason": reason, "event": "events.lines_dropped"}

    def _write(self, text: str, record: dict) -> None:
        """One console line; on OSError drop it and count it (see __init__)."""
        def write(line: str) -> None:
            print(line, file=self._stream, flush=True)

        try:
            if self._dropped:
                note = self._note(record, self._dropped, "console", self._drop_reason)
                write(to_json(note) if self._console == "json" else format_pretty(note, self._color))
                self._dropped = 0
            write(text)
        except OSError as exc:
            self._dropped += 1
            self._drop_reason = f"{type(exc).__name__}: {exc}"[:200]

    def close(self) -> None:
        if self._publisher:
            self._publisher.close()
        if self._file:
            try:
                self._file.close()
            except OSError:  # what a full disk still holds back is lost; the process ends anyway
                pass


def make_logger(cfg: Any, role: str, worker_id: str, *, console: str | None = None, stream: TextIO | None = None,
                keys: Any = None):
    """Logger bound with run id, role and worker id. `cfg` is a RunConfig. Returns (logger, sink).

    `keys` (a security.Keyring) authenticates the bus publisher; default: the role's key from the config."""
    events = cfg.events
    file_path = None
    if events.to_file:
        folder = Path(cfg.run.run_dir) / "events"
        folder.mkdir(parents=True, exist_ok=True)
        file_path = folder / f"{role}-{worker_id}.jsonl"
    publisher = None
    if events.to_bus:
        from areal_mq.security import Keyring

        publisher = BusPublisher(cfg.brokers.bus_in_addr, keys=keys or Keyring.from_config(cfg, role))
    sink = EventSink(file_path, publisher, console or events.console, LEVELS[events.level], stream)
    logger = structlog.wrap_logger(
        None,
        processors=[structlog.contextvars.merge_contextvars, sink],
        wrapper_class=structlog.BoundLogger,
    )
    return logger.bind(run_id=cfg.run.name, role=role, worker_id=worker_id, pid=os.getpid()), sink
