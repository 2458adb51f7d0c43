"""A process must not die because it cannot log, and a full disk must not cost event lines (issue 40).

The soak's disk_full fault first ended the controller and a rollout worker with ENOSPC raised out of a log call;
the sink then dropped what it could not write, and the 60-minute soak of 2026-11-28 lost two `trainer.step` lines
that way (its audit saw two versions never trained). The events file now keeps unwritten lines in a bounded
backlog and writes them, whole and in order, once space returns; only the console (and lines past the backlog
bound) drop and count, with one `events.lines_dropped` line once writing works again."""
from __future__ import annotations

import errno
import io
import json
import subprocess
import sys

import structlog

from areal_mq.telemetry.log import EventsFile, EventSink


class FullDisk(io.StringIO):
    """A stream that refuses every write while `full`."""

    def __init__(self) -> None:
        super().__init__()
        self.full = False

    def write(self, text: str) -> int:
        if self.full:
            raise OSError(errno.ENOSPC, "No space left on device")
        return super().write(text)


class FillableFile(EventsFile):
    """The real events file, whose writes fail while `full` (after writing `partial` bytes, as the kernel does)."""

    full = False
    partial = 0

    def _raw_write(self, data):
        if not self.full:
            return super()._raw_write(data)
        if self.partial:
            n, self.partial = super()._raw_write(data[:self.partial]), 0
            return n
        raise OSError(errno.ENOSPC, "No space left on device")


def _emit(sink: EventSink, event: str) -> None:
    try:
        sink(None, "info", {"event": event, "role": "controller", "pid": 7})
    except structlog.DropEvent:
        pass


def _lines(path):
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_a_full_disk_delays_event_lines_and_drops_console_lines_without_raising(tmp_path):
    console = FullDisk()
    path = tmp_path / "events.jsonl"
    sink = EventSink(path, None, "json", 20, stream=console)
    sink._file.close()
    sink._file = FillableFile(path)
    _emit(sink, "a")
    console.full = sink._file.full = True
    sink._file.partial = 20  # the first line is cut part-way, like a write that meets the end of the disk
    for name in ("b", "c", "d"):
        _emit(sink, name)  # nothing raised
    text = path.read_text()
    assert json.loads(text.splitlines()[0])["event"] == "a" and text.count("\n") == 1  # and 20 bytes of "b"
    console.full = sink._file.full = False
    _emit(sink, "e")
    assert [x["event"] for x in _lines(path)] == ["a", "b", "c", "d", "e"]  # whole lines, in order, none lost
    lines = [json.loads(x) for x in console.getvalue().splitlines()]
    assert [x["event"] for x in lines] == ["a", "events.lines_dropped", "e"]
    note = lines[1]
    assert note["lines"] == 3 and "No space left" in note["reason"] and note["role"] == "controller"
    sink.close()


def test_lines_past_the_backlog_bound_are_dropped_counted_and_named(tmp_path):
    path = tmp_path / "events.jsonl"
    sink = EventSink(path, None, "none", 20)
    sink._file.close()
    sink._file = FillableFile(path, max_backlog=300)
    sink._file.full = True
    for i in range(20):
        _emit(sink, f"e{i}")
    kept = len(sink._file.backlog.splitlines())
    assert 0 < kept < 20 and sink._file.dropped == 20 - kept
    sink._file.full = False
    _emit(sink, "after")
    events = _lines(path)
    assert [x["event"] for x in events[:kept]] == [f"e{i}" for i in range(kept)]
    assert [x["event"] for x in events[kept:]] == ["after", "events.lines_dropped"]
    assert events[-1]["lines"] == 20 - kept and events[-1]["to"] == "file"
    sink.close()


_REAL_LIMIT = r"""
import resource, signal, sys
import structlog
from areal_mq.telemetry.log import EventSink

signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # past the limit a write fails with EFBIG, like a full disk
path = sys.argv[1]
sink = EventSink(path, None, "none", 20)
def emit(name):
    try:
        sink(None, "info", {"event": name, "role": "trainer", "pid": 7, "pad": "x" * 90})
    except structlog.DropEvent:
        pass
emit("first")
soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
resource.setrlimit(resource.RLIMIT_FSIZE, (200, hard))  # the kernel takes part of the next line, then refuses
for i in range(5):
    emit(f"held{i}")
resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
emit("last")
sink.close()
"""


def test_a_real_short_write_leaves_no_cut_line(tmp_path):
    path = tmp_path / "events.jsonl"
    subprocess.run([sys.executable, "-c", _REAL_LIMIT, str(path)], check=True, timeout=60)
    assert [x["event"] for x in _lines(path)] == ["first", *[f"held{i}" for i in range(5)], "last"]
