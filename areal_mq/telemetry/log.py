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


class EventSink:
    """The structlog processor at the end of the chain: fans an event out, then drops it."""

    def __init__(self, file_path: Path | None, publisher: BusPublisher | None, console: str, min_level: int,
                 stream: TextIO | None = None):
        self._file = open(file_path, "a", buffering=1, encoding="utf-8") if file_path else None
        self._publisher = publisher
        self._console = console
        self._min_level = min_level
        self._stream = stream or sys.stderr
        self._color = console == "pretty" and self._stream.isatty()
        self._lock = threading.Lock()
        # Lines the events file or the console could not take (a full disk: ENOSPC; a closed pipe). A process must
        # not die because it cannot log: the line is dropped, counted, and once writing works again one
        # `events.lines_dropped` line says how many went and why (the soak's disk_full fault found processes
        # ending on ENOSPC from a log call).
        self._dropped = {"file": 0, "console": 0}
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
                self._write("file", lambda text: self._file.write(text + "\n"), line, record)
            if self._console == "json":
                self._write("console", lambda text: print(text, file=self._stream, flush=True), line, record)
            elif self._console == "pretty":
                self._write("console", lambda text: print(text, file=self._stream, flush=True),
                            format_pretty(record, self._color), record)
        if self._publisher:
            self._publisher.put(record)
        raise structlog.DropEvent

    def _write(self, where: str, write: Any, text: str, record: dict) -> None:
        """Write one line; on OSError drop it and count it (see __init__)."""
        try:
            if self._dropped[where]:
                note = {"ts": time.time(), "level": "warning", **{k: record[k] for k in ("run_id", "role", "worker_id",
                        "pid") if k in record}, "lines": self._dropped[where], "to": where,
                        "reason": self._drop_reason, "event": "events.lines_dropped"}
                write(to_json(note) if where == "file" or self._console == "json" else
                      format_pretty(note, self._color))
                self._dropped[where] = 0
            write(text)
        except OSError as exc:
            self._dropped[where] += 1
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
