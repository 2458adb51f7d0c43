"""The sample store's append-only record log: framing, checksums, streaming replay, atomic rewrite.

File (run_dir/store/samples.log): the 12 bytes b"AMQ-SLOG v2\\n", then records of
    [u32 magic "SLOG"][u32 length][u32 crc32 of (length bytes + payload)][payload: one msgpack map]
all little-endian. Why each part:
- the crc makes a damaged record *detected*, never parsed as something else;
- the magic lets replay find the next record after a damaged one (a candidate counts only if its crc
  matches), so a bad record costs that record, never the acknowledged records behind it;
- only a torn *tail* (no valid record after it: a crash in the middle of a write) is cut off. A bad record
  anywhere else is skipped: its bytes are copied to store/bad-records/<offset>.bin and an error event
  `store.log_record_bad` names its offset. The file is never truncated before a valid record.
Logs written before checksums (v1: [u32 length][msgpack] records, no file header) are still read; the store
then rewrites its state as a v2 log and keeps the old file beside it as samples.log.v1.
Durability: every append is flushed to the OS before the store answers, so an acknowledged record survives
kill -9 of the store; with fsync=True it is also fsynced, so it survives power loss or a kernel crash.
"""
from __future__ import annotations

import os
import struct
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack

FILE_MAGIC = b"AMQ-SLOG v2\n"
_HEAD = struct.Struct("<III")  # magic, payload length, crc32(length bytes + payload)
_REC_MAGIC = 0x474F4C53  # b"SLOG" little-endian
_MAGIC_BYTES = struct.pack("<I", _REC_MAGIC)
_LEN = struct.Struct("<I")
_BIN32 = struct.Struct(">BI")  # msgpack bin 32: marker 0xc6, big-endian length
_SCAN_CHUNK = 1 << 20
_IOV_MAX = 1024  # buffers per writev call (Linux's IOV_MAX)


def _crc(pieces: list) -> int:
    crc = 0
    for p in pieces:
        crc = zlib.crc32(p, crc)
    return crc


class SampleLog:
    """Append records; replay them (streamed, record by record); rewrite the whole log atomically."""

    def __init__(self, path: Path, fsync: bool = False, log: Any = None, max_record_bytes: int = 1 << 40):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.fsync, self.log, self.max_record_bytes = fsync, log, max_record_bytes
        self._file = None
        self._cut_to: int | None = None  # a failed write's start, when cutting it back in place failed
        self.size = 0  # bytes in the file, kept current by replay, append and rewrite
        self.legacy = False  # the replayed file was a v1 log (no checksums): rewrite it
        self.bad_records = 0

    # ------------------------------------------------------------ replay
    def replay(self) -> Iterator[tuple[int, int, Any]]:
        """(offset, bytes on disk, record) for every readable record, in file order."""
        if not self.path.exists() or self.path.stat().st_size == 0:
            self.size = 0
            return
        with open(self.path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            self.legacy = f.read(len(FILE_MAGIC)) != FILE_MAGIC
            records = self._scan_v1(f, size) if self.legacy else self._scan_v2(f, size)
            for offset, nbytes, payload in records:
                try:
                    rec = msgpack.unpackb(payload, raw=False)
                except Exception as exc:  # noqa: BLE001 - crc ok but not msgpack: written wrong, skip it
                    self.quarantine(offset, nbytes, f"not msgpack: {exc}")
                    continue
                yield offset, nbytes, rec
        self.size = self.path.stat().st_size

    def _read_at(self, f: Any, pos: int, size: int) -> bytes | None:
        """The payload of a valid v2 record starting at `pos`, else None."""
        f.seek(pos)
        head = f.read(_HEAD.size)
        if len(head) < _HEAD.size:
            return None
        magic, n, crc = _HEAD.unpack(head)
        if magic != _REC_MAGIC or n > self.max_record_bytes or pos + _HEAD.size + n > size:
            return None
        payload = f.read(n)
        return payload if zlib.crc32(payload, zlib.crc32(head[4:8])) == crc else None

    def _next_valid(self, f: Any, start: int, size: int) -> int | None:
        """Offset of the first valid record at or after `start` (found by its magic, confirmed by its crc)."""
        pos = start
        while pos < size:
            f.seek(pos)
            chunk = f.read(_SCAN_CHUNK)
            i = chunk.find(_MAGIC_BYTES)
            while i != -1:
                if self._read_at(f, pos + i, size) is not None:
                    return pos + i
                i = chunk.find(_MAGIC_BYTES, i + 1)
            pos += max(1, len(chunk) - (len(_MAGIC_BYTES) - 1))
        return None

    def _scan_v2(self, f: Any, size: int) -> Iterator[tuple[int, int, bytes]]:
        pos = len(FILE_MAGIC)
        while pos < size:
            payload = self._read_at(f, pos, size)
            if payload is not None:
                yield pos, _HEAD.size + len(payload), payload
                pos += _HEAD.size + len(payload)
                continue
            nxt = self._next_valid(f, pos + 1, size)
            if nxt is None:  # nothing valid behind it: a torn tail
                self._cut_tail(pos, size)
                return
            self.quarantine(pos, nxt - pos, "bad checksum or framing")
            pos = nxt

    def _scan_v1(self, f: Any, size: int) -> Iterator[tuple[int, int, bytes]]:
        """Old logs: no checksum and no magic to resynchronise on, so reading stops at the first record that
        does not fit; nothing is truncated (the store keeps the whole old file as samples.log.v1)."""
        pos = 0
        while pos + _LEN.size <= size:
            f.seek(pos)
            (n,) = _LEN.unpack(f.read(_LEN.size))
            if pos + _LEN.size + n > size:
                break
            yield pos, _LEN.size + n, f.read(n)
            pos += _LEN.size + n
        if pos < size and self.log:
            self.log.warning("store.log_v1_stopped", offset=pos, bytes=size - pos, path=str(self.path),
                             hint="an old-format log has no checksums: records from this offset on are not "
                                  "read; the file is kept as samples.log.v1")

    def _cut_tail(self, pos: int, size: int) -> None:
        if self.log:
            self.log.warning("store.log_tail_cut", offset=pos, bytes=size - pos,
                             reason="torn tail: no valid record after this offset (a crash mid-write)")
        with open(self.path, "r+b") as f:
            f.truncate(pos)

    def quarantine(self, offset: int, nbytes: int, reason: str) -> None:
        """Skip the record at `offset`: copy its bytes to bad-records/ and say so loudly."""
        self.bad_records += 1
        kept = self.path.parent / "bad-records" / f"{self.path.name}.{offset}.bin"
        kept.parent.mkdir(exist_ok=True)
        with open(self.path, "rb") as src, open(kept, "wb") as dst:
            src.seek(offset)
            left = nbytes
            while left > 0:
                chunk = src.read(min(left, _SCAN_CHUNK))
                if not chunk:
                    break
                dst.write(chunk)
                left -= len(chunk)
        if self.log:
            self.log.error("store.log_record_bad", offset=offset, bytes=nbytes, reason=reason, kept=str(kept),
                           hint="this record is skipped (its sample or acks are lost); the records after it "
                                "are replayed. If the reason is a frame limit, raise brokers.max_frame_mb "
                                "and restore the record from the kept copy")

    # ------------------------------------------------------------ writing
    def _open(self) -> Any:
        if self._file is None:
            if self._cut_to is not None:  # a failed write could not be undone in place: undo it now
                os.truncate(self.path, self._cut_to)
                self._cut_to = None
            new = not self.path.exists() or self.path.stat().st_size == 0
            self._file = open(self.path, "ab", buffering=0)  # unbuffered: nothing of a failed write lingers
            self.size = 0 if new else self.path.stat().st_size
            if new:
                try:
                    self._write_or_undo([FILE_MAGIC])
                except BaseException:
                    self.close()  # the next write starts the file again, header first
                    raise
                self._sync_dir()
        return self._file

    def _write_or_undo(self, pieces: list) -> None:
        """Write `pieces` at the end of the file, all or nothing.

        A write that fails part-way (ENOSPC, EIO) leaves no bytes behind: the file is cut back to where the
        write began. Without that, a full disk left a partial record *before* the records written once space
        came back, and replay had to quarantine it as a bad record (the 10-minute soak of 2026-11-28)."""
        start = self.size
        fd = self._file.fileno()
        views = [v for v in (memoryview(p).cast("B") for p in pieces) if v.nbytes]
        total = sum(v.nbytes for v in views)
        try:
            while views:
                done = os.writev(fd, views[:_IOV_MAX])
                while views and done >= views[0].nbytes:
                    done -= views[0].nbytes
                    views.pop(0)
                if done:
                    views[0] = views[0][done:]
            if self.fsync:
                os.fsync(fd)
        except BaseException:
            try:
                os.ftruncate(fd, start)
            except OSError:  # cut it before the next write instead
                self._cut_to = start
                self.close()
            raise
        self.size = start + total

    def _write(self, pieces: list) -> int:
        n = sum(memoryview(p).nbytes for p in pieces)
        length = _LEN.pack(n)
        self._open()
        self._write_or_undo([_HEAD.pack(_REC_MAGIC, n, _crc([length, *pieces])), *pieces])
        return _HEAD.size + n

    def append(self, record: dict) -> int:
        """Write one record; returns its size on disk."""
        return self._write([msgpack.packb(record, use_bin_type=True)])

    def append_put(self, frames: list) -> int:
        """The record {"op": "put", "frames": [bin, ...]}, written without copying the frames.

        Same bytes as append() would write (bin32 for every frame, still valid msgpack for replay), but
        each received buffer goes straight to the file: a 192 MB sample costs one write, not three copies.
        """
        buffers = [memoryview(getattr(f, "buffer", f)).cast("B") for f in frames]
        pieces: list = [b"\x82" + msgpack.packb("op") + msgpack.packb("put") + msgpack.packb("frames")
                        + msgpack.Packer().pack_array_header(len(buffers))]
        for buf in buffers:
            pieces += [_BIN32.pack(0xC6, buf.nbytes), buf]
        return self._write(pieces)

    def rewrite(self, fill: Any) -> None:
        """Replace the log atomically by what `fill(new_log)` appends: write a temporary file, fsync it,
        rename it over the log, fsync the directory. A crash at any point leaves the old or the new log."""
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.unlink(missing_ok=True)
        new = SampleLog(tmp, fsync=False, log=self.log, max_record_bytes=self.max_record_bytes)
        try:
            fill(new)
            os.fsync(new._open().fileno())
        except BaseException:  # a full disk mid-rewrite: the old log stays, the partial copy goes
            new.close()
            tmp.unlink(missing_ok=True)
            raise
        new.close()
        self.close()
        if self.legacy and self.path.exists():  # keep the old-format file: it may hold what v1 could not read
            old = self.path.with_name(self.path.name + ".v1")
            old.unlink(missing_ok=True)
            os.link(self.path, old)
        os.replace(tmp, self.path)
        self._sync_dir()
        self.size, self.legacy = new.size, False

    def _sync_dir(self) -> None:
        fd = os.open(self.path.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def close(self) -> None:
        if self._file:
            self._file.close()
            self._file = None
