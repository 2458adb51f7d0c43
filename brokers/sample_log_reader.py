"""Read one sample from the sample store's log without touching it, for `areal-mq trace` (the CLI passes
`read_sample` to areal_mq/telemetry/trace.py: the core library never imports a broker).

What: `read_sample(path, sample_id)` -> the Sample last put under that id, or None (never stored, or gone in a
compaction after it was trained or dropped; trained samples stay readable until then). Why: per-token versions, loss masks and per-completion reward details live only
in the stored Sample. How: brokers/sample_log.py's own reader (one definition of the framing), with its two
repairs (cutting a torn tail, quarantining a bad record) turned off: a tool reading a live store's log must
never write to it; a record it cannot read is skipped.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from areal_mq.brokers.sample_log import SampleLog


class ReadOnlyLog(SampleLog):
    """SampleLog.replay without its repairs: a torn tail ends the scan, a bad record is skipped."""

    def _cut_tail(self, pos: int, size: int) -> None:
        return None

    def quarantine(self, offset: int, nbytes: int, reason: str) -> None:
        self.bad_records += 1


def read_sample(path: Path, sample_id: str) -> Any:
    """The last Sample put as `sample_id` still in the log (trained or not), or None."""
    from areal_mq import protocol
    from areal_mq.messages import Sample

    if not Path(path).exists():
        return None
    found, needle = None, sample_id.encode()
    for _offset, _nbytes, rec in ReadOnlyLog(Path(path)).replay():
        if isinstance(rec, dict) and rec.get("op") == "put" and \
                any(needle in bytes(f) for f in rec.get("frames") or []):  # decode only candidates
            try:
                msg = protocol.decode(rec["frames"]).msg
            except Exception:  # noqa: BLE001 - an unreadable record is the store's business, not ours
                continue
            if isinstance(msg, Sample) and msg.sample_id == sample_id:
                found = msg
    return found
