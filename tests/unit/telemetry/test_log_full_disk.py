"""A process must not die because it cannot log (issue 40: the soak's disk_full fault ended the controller and a
rollout worker with ENOSPC raised out of a log call). The events sink drops what the file or the console cannot
take, counts it, and writes one `events.lines_dropped` line once writing works again."""
from __future__ import annotations

import errno
import io
import json

import structlog

from areal_mq.telemetry.log import EventSink


class FullDisk(io.StringIO):
    """A stream that refuses every write while `full`."""

    def __init__(self) -> None:
        super().__init__()
        self.full = False

    def write(self, text: str) -> int:
        if self.full:
            raise OSError(errno.ENOSPC, "No space left on device")
        return super().write(text)


def _emit(sink: EventSink, event: str) -> None:
    try:
        sink(None, "info", {"event": event, "role": "controller", "pid": 7})
    except structlog.DropEvent:
        pass


def test_a_full_disk_drops_log_lines_without_raising_then_says_how_many(tmp_path):
    console = FullDisk()
    sink = EventSink(tmp_path / "events.jsonl", None, "json", 20, stream=console)
    events_file = FullDisk()
    sink._file = events_file  # the file the sink opened, swapped for one that can be filled
    _emit(sink, "a")
    console.full = events_file.full = True
    for name in ("b", "c", "d"):
        _emit(sink, name)  # nothing raised
    console.full = events_file.full = False
    _emit(sink, "e")
    for stream in (events_file, console):
        lines = [json.loads(x) for x in stream.getvalue().splitlines()]
        assert [x["event"] for x in lines] == ["a", "events.lines_dropped", "e"]
        note = lines[1]
        assert note["lines"] == 3 and "No space left" in note["reason"] and note["role"] == "controller"
    sink.close()
