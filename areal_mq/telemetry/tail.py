"""`areal-mq events tail`: follow structured events live from the bus or from a run directory's files.

Filters: --role, --event (glob, e.g. 'broker.*'), --level (minimum), and any KEY=VALUE on the record.
Output: one pretty line per event, or the raw JSON line with --json.
"""
from __future__ import annotations

import fnmatch
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, TextIO

from areal_mq.telemetry.log import LEVELS, format_pretty, to_json


@dataclass
class EventFilter:
    role: str | None = None
    event: str | None = None
    level: str = "debug"
    where: dict[str, str] = field(default_factory=dict)

    def __call__(self, rec: dict) -> bool:
        if self.role and rec.get("role") != self.role:
            return False
        if self.event and not fnmatch.fnmatch(str(rec.get("event", "")), self.event):
            return False
        if LEVELS.get(str(rec.get("level", "info")), 20) < LEVELS[self.level]:
            return False
        return all(str(rec.get(k)) == v for k, v in self.where.items())


def parse_where(items: list[str]) -> dict[str, str]:
    out = {}
    for item in items:
        if "=" not in item:
            raise ValueError(f"filter {item!r} must look like key=value")
        k, v = item.split("=", 1)
        out[k] = v
    return out


def iter_files(run_dir: Path, follow: bool, poll_s: float = 0.2, stop_after_s: float | None = None) -> Iterator[dict]:
    """Existing events (merged by time), then new lines as they are appended if `follow`."""
    folder = run_dir / "events"
    if not folder.is_dir():
        raise FileNotFoundError(f"no events folder at {folder} (is {run_dir} a run directory?)")
    offsets: dict[Path, int] = {}
    backlog: list[dict] = []
    for path in sorted(folder.glob("*.jsonl")):
        backlog.extend(read_new_lines(path, offsets))
    yield from sorted(backlog, key=lambda r: r.get("ts", 0))
    started = time.monotonic()
    while follow and (stop_after_s is None or time.monotonic() - started < stop_after_s):
        fresh: list[dict] = []
        for path in sorted(folder.glob("*.jsonl")):
            fresh.extend(read_new_lines(path, offsets))
        yield from sorted(fresh, key=lambda r: r.get("ts", 0))
        if not fresh:
            time.sleep(poll_s)


def read_events(run_dir: Path, name: str | None = None) -> list[dict]:
    """Every event record of a run so far (merged by time; half-written lines skipped), or only those named
    `name`; [] before the run has an events folder. For audits of a finished or running run."""
    if not (Path(run_dir) / "events").is_dir():
        return []
    return [r for r in iter_files(Path(run_dir), follow=False) if name is None or r.get("event") == name]


def read_new_lines(path: Path, offsets: dict[Path, int]) -> list[dict]:
    """JSON records appended to `path` since the offset remembered in `offsets` (complete lines only)."""
    if not path.exists():
        return []
    out = []
    with open(path, "rb") as f:
        f.seek(offsets.get(path, 0))
        data = f.read()
    end = data.rfind(b"\n") + 1  # a half-written last line waits for the next round
    offsets[path] = offsets.get(path, 0) + end
    for line in data[:end].splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def iter_bus(address: str, stop_after_s: float | None = None, keys=None) -> Iterator[dict]:
    """Event records from the bus's XPUB side; `keys` (security.Keyring) authenticates us."""
    from areal_mq.client import SignalSubscriber

    sub = SignalSubscriber(address, topics=("events",), keys=keys)
    started = time.monotonic()
    try:
        while stop_after_s is None or time.monotonic() - started < stop_after_s:
            got = sub.recv(timeout=0.2)
            if got is not None:
                yield got[1].msg.record
    finally:
        sub.close()


def emit(records: Iterator[dict], keep: EventFilter, as_json: bool, out: TextIO = sys.stdout,
         limit: int | None = None) -> int:
    shown = 0
    color = out.isatty()
    for rec in records:
        if not keep(rec):
            continue
        print(to_json(rec) if as_json else format_pretty(rec, color), file=out, flush=True)
        shown += 1
        if limit is not None and shown >= limit:
            break
    return shown
