"""Segment: one append-only file of SSD records, named by an increasing id (``000000000042.seg``).

Life of a segment::

    create() ──append()*──▶ active ──seal()──▶ sealed ──retire()──▶ unlinked; fd closed once unpinned
                                               ▲
    existing() (a file found at start-up) ─────┘   a process never appends to a segment it did not create

Why never reopen for appending: the tail of a segment left by a killed process may hold a torn record.
Starting a fresh segment after every restart leaves that tail alone: scans ignore it and the bytes are
dead space that compaction or eviction reclaims with the rest of the segment.

File descriptors and pins: a sealed segment opens its file lazily (``open_fd``) and the store closes
idle ones beyond a cap (``close_fd``), so a full 512 GiB tier (2,048 segments) does not need 2,048
descriptors. Anyone reading outside the store's metadata lock ``pin()``s the segment first and
``unpin()``s afterwards: a pinned descriptor is never closed, and ``retire()`` unlinks the file at once
but closes the descriptor only when the last pin is dropped, so a concurrent read never sees a closed
(or reused) descriptor. Pins, ``open_fd``/``close_fd`` and ``retired`` are guarded by the store's
metadata lock; ``append``, ``sync``, ``seal``, ``size`` and ``unsynced`` belong to the store's write
lock (one appender at a time); ``retire`` needs both. ``read`` and ``scan`` need an open, pinned file.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from flashtier.kvstore.ssd.record import (
    HEADER_BYTES,
    MAGIC,
    LegacyRecord,
    RecordCorrupt,
    RecordHeader,
    decode_header,
)

SEGMENT_SUFFIX = ".seg"
FILE_MODE = 0o600  # segment and LOCK files: owner only
DIR_MODE = 0o700  # an SSD directory the store creates
_NAME = re.compile(r"^(\d{12})\.seg$")
_SCAN_CHUNK = 1 << 20  # bytes read at a time while searching for the next magic after a bad header


def segment_name(segment_id: int) -> str:
    """The file name of segment ``segment_id``; ValueError outside [0, 10^12)."""
    if not 0 <= segment_id < 10**12:
        raise ValueError(f"segment id must be in [0, 10^12), got {segment_id}")
    return f"{segment_id:012d}{SEGMENT_SUFFIX}"


def parse_segment_name(name: str) -> int | None:
    """Inverse of ``segment_name``; None for any other file name."""
    m = _NAME.match(name)
    return int(m.group(1)) if m else None


@dataclass(slots=True)
class SegmentScan:
    """What a header scan found in one segment file."""

    records: list[tuple[int, RecordHeader]] = field(default_factory=list)  # (offset, header), file order
    corrupt: int = 0  # damaged headers (skipped by resynchronising on the next valid header)
    torn_bytes: int = 0  # an incomplete record (or zero fill) at the tail, ignored
    end: int = 0  # file size when scanned
    legacy: list[tuple[int, int]] = field(default_factory=list)  # (offset, bytes) of version-1 records, skipped

    @property
    def legacy_bytes(self) -> int:
        return sum(n for _, n in self.legacy)


class Segment:
    """One segment file: append at the end, read anywhere, scan headers, fsync, retire."""

    def __init__(self, segment_id: int, path: Path, fd: int | None, size: int, *, sealed: bool) -> None:
        self.segment_id = segment_id
        self.path = path
        self.size = size  # bytes in the file (appended so far / found at open)
        self.sealed = sealed  # no more appends
        self.retired = False  # unlinked; fd closes when pins reach 0
        self.unsynced = 0  # bytes appended since the last fsync
        self.pins = 0
        self._closing = False
        self._fd: int | None = fd

    @classmethod
    def create(cls, directory: Path, segment_id: int) -> Segment:
        """A new empty, active segment, mode 0600 whatever the umask (KV bytes are prompt content).
        OSError (FileExistsError included) if it cannot be created; nothing is left open then."""
        path = directory / segment_name(segment_id)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), FILE_MODE)
        try:
            os.fchmod(fd, FILE_MODE)  # the umask may have removed bits of FILE_MODE
        except OSError:
            os.close(fd)
            try:
                os.unlink(path)  # else the next create of this id fails with FileExistsError for ever
            except OSError:
                pass
            raise
        return cls(segment_id, path, fd, 0, sealed=False)

    @classmethod
    def existing(cls, path: Path) -> Segment:
        """An existing segment file, sealed, not opened yet. ValueError for a name that is not a segment
        name; OSError if it cannot be stat'ed."""
        segment_id = parse_segment_name(path.name)
        if segment_id is None:
            raise ValueError(f"not a segment file name: {path.name!r}")
        return cls(segment_id, path, None, os.stat(path).st_size, sealed=True)

    def __repr__(self) -> str:
        state = "retired" if self.retired else "sealed" if self.sealed else "active"
        return f"Segment({self.segment_id}, {self.size} B, {state}, pins={self.pins})"

    @property
    def fd(self) -> int:
        assert self._fd is not None, f"segment {self.segment_id} is not open"
        return self._fd

    @property
    def is_open(self) -> bool:
        return self._fd is not None

    def open_fd(self) -> None:
        """Open the file read-only if it is not open. OSError if it cannot be opened."""
        assert not self.retired and not self._closing, f"open of {self!r}"
        if self._fd is None:
            self._fd = os.open(self.path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))

    def close_fd(self) -> None:
        """Close an idle sealed segment's descriptor (it reopens on the next ``open_fd``)."""
        assert self.pins == 0 and self.sealed, f"close_fd on {self!r}"
        self._close()

    # ---- I/O ---------------------------------------------------------------------------------------
    def append(self, data: bytes) -> int:
        """Write ``data`` at the end; returns its offset. Mutates ``size`` and ``unsynced``.

        Needs the store's write lock. Failure: OSError, after which the tail may hold part of ``data``;
        the caller seals the segment (a scan treats such a tail as torn) and ``size`` is the file size.
        """
        assert not self.sealed and not self.retired, f"append to {self!r}"
        offset, view = self.size, memoryview(data)
        try:
            while view:
                n = os.pwrite(self.fd, view, offset + (len(data) - len(view)))
                view = view[n:]
        except OSError:
            self.size = os.fstat(self.fd).st_size
            raise
        self.size += len(data)
        self.unsynced += len(data)
        return offset

    def read(self, offset: int, n: int) -> bytes:
        """Up to ``n`` bytes at ``offset`` (fewer only at end of file). Needs a pin or the write lock."""
        parts, done = [], 0
        while done < n:
            chunk = os.pread(self.fd, n - done, offset + done)
            if not chunk:
                break
            parts.append(chunk)
            done += len(chunk)
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def sync(self) -> None:
        """fsync the file; clears ``unsynced``. Needs the write lock. Failure: OSError (still unsynced)."""
        os.fsync(self.fd)
        self.unsynced = 0

    def seal(self) -> None:
        self.sealed = True

    # ---- lifetime of the descriptor ----------------------------------------------------------------
    def pin(self) -> None:
        assert not self.retired, f"pin on {self!r}"
        self.pins += 1

    def unpin(self) -> None:
        assert self.pins > 0, f"unpin without pin on {self!r}"
        self.pins -= 1
        if (self.retired or self._closing) and self.pins == 0:
            self._close()

    def retire(self) -> None:
        """Unlink the file now; close the descriptor now or at the last ``unpin``. Needs both store locks."""
        self.sealed = self.retired = True
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        if self.pins == 0:
            self._close()

    def close(self) -> None:
        """Close the descriptor now or at the last ``unpin`` (store shutdown); the file stays."""
        self.sealed = self._closing = True
        if self.pins == 0:
            self._close()

    def _close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    # ---- start-up scan -----------------------------------------------------------------------------
    def scan(self) -> SegmentScan:
        """Read every header (not payloads) front to back.

        A header that fails its checks is counted corrupt and the scan resumes at the next offset that
        holds a valid header (found by its magic); if none follows, the rest is a torn tail when it is
        all zeros and one more corrupt record otherwise. A valid header whose payload runs past the end
        of the file is a torn tail. An intact version-1 record (ssd/record.py: no tenant) is skipped whole
        and listed in ``legacy``, never indexed. Payload checksums are verified later, on read.
        """
        out = SegmentScan(end=os.fstat(self.fd).st_size)  # the file may be longer than a torn ``size``
        offset = 0
        while offset < out.end:
            if out.end - offset < HEADER_BYTES:
                out.torn_bytes = out.end - offset
                break
            try:
                header = decode_header(self.read(offset, HEADER_BYTES))
            except LegacyRecord as old:
                if offset + old.record_bytes > out.end:
                    out.torn_bytes = out.end - offset
                    break
                out.legacy.append((offset, old.record_bytes))
                offset += old.record_bytes
                continue
            except RecordCorrupt:
                nxt = self._next_header(offset + 1, out.end)
                if nxt is None:
                    if self._all_zero(offset, out.end):
                        out.torn_bytes = out.end - offset
                    else:
                        out.corrupt += 1
                    break
                out.corrupt += 1
                offset = nxt
                continue
            if offset + header.record_bytes > out.end:
                out.torn_bytes = out.end - offset
                break
            out.records.append((offset, header))
            offset += header.record_bytes
        return out

    def _next_header(self, start: int, end: int) -> int | None:
        """Offset >= start of the next valid header whose record fits in the file, or None."""
        pos = start
        while pos < end:
            chunk = self.read(pos, min(_SCAN_CHUNK, end - pos) + len(MAGIC) - 1)
            i = chunk.find(MAGIC)
            while i != -1:
                cand = pos + i
                try:
                    header = decode_header(self.read(cand, HEADER_BYTES))
                    if cand + header.record_bytes <= end:
                        return cand
                except LegacyRecord as old:
                    if cand + old.record_bytes <= end:
                        return cand
                except RecordCorrupt:
                    pass
                i = chunk.find(MAGIC, i + 1)
            pos += _SCAN_CHUNK
        return None

    def _all_zero(self, start: int, end: int) -> bool:
        pos = start
        while pos < end:
            chunk = self.read(pos, min(_SCAN_CHUNK, end - pos))
            if chunk.count(0) != len(chunk):
                return False
            pos += len(chunk)
        return True
