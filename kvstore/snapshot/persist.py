"""The embedded snapshot pool across a clean restart: saved beside the SSD tier at shutdown, loaded at start.

The embedded pool (no ``--redis-url``) lives in the server's memory, so without this a restart on the same
``--kv-dir`` finds every SSD block again but no snapshot, and every returning conversation resumes by an
approximate bounded replay. ``save_pool`` writes the live snapshots to ``KV_DIR/snapshots.embedded`` at a
clean shutdown; ``load_pool`` reads them back at start-up and removes the file, so a later crash (SIGKILL)
never brings back a stale copy (the pool is then empty, as before)::

    file    = magic "FTSP" | version u32 | record ...
    record  = expires_at_unix_ms u64 | value length u64 | crc32c u32 of those 16 bytes
              | value (kvstore/snapshot/key.py ``Snapshot.encode``: its own header, key and crc32c)

Expiry is stored as wall-clock time, so a snapshot's TTL keeps running while the server is down; one
whose expiry passed is not loaded. Written to ``snapshots.embedded.tmp``, fsynced, renamed over the
file, then the directory fsynced: a reader sees the old file or the new one, never half of one.
A damaged or truncated file costs misses, never a failed start: loading stops at the first bad record
(the ones before it are kept), logs one warning and counts it.
"""

from __future__ import annotations

import logging
import os
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass

import crc32c

from flashtier.kvstore.snapshot.key import Snapshot, SnapshotCorrupt
from flashtier.kvstore.snapshot.pool import EmbeddedSnapshotPool

log = logging.getLogger("flashtier.kvstore.snapshot.persist")

FILE_NAME = "snapshots.embedded"
MAGIC = b"FTSP"
VERSION = 1
_FILE_HEADER = struct.Struct("<4sI")
_RECORD = struct.Struct("<QQ")  # expiry (unix ms), value length
_CRC = struct.Struct("<I")
_MAX_VALUE = 1 << 32  # a length beyond this is damage, not a snapshot (a V4.1-Flash value is ~11.4 MiB)


@dataclass(frozen=True)
class LoadResult:
    loaded: int = 0  # snapshots put back into the pool
    expired: int = 0  # records whose TTL ran out while the server was down
    corrupt: int = 0  # 1 when the file was damaged or truncated (loading stopped there), else 0
    refused: int = 0  # records the pool did not take (too large for its budget)


def save_pool(pool: EmbeddedSnapshotPool, directory: str, *, wall_clock: Callable[[], float] = time.time) -> int:
    """Write ``pool``'s live snapshots to ``directory/snapshots.embedded`` (temporary file, fsync, atomic
    rename, directory fsync); returns how many. Mutates only the file (and drops the pool's expired
    entries). Failure: OSError propagates with the temporary file removed and the previous file intact."""
    entries = pool.live_entries()
    path = os.path.join(directory, FILE_NAME)
    tmp = path + ".tmp"
    now = wall_clock()
    try:
        with open(tmp, "wb") as f:
            f.write(_FILE_HEADER.pack(MAGIC, VERSION))
            for key, payload, ttl_left in entries:
                value = Snapshot(key, payload).encode()
                head = _RECORD.pack(int((now + ttl_left) * 1000), len(value))
                f.write(head + _CRC.pack(crc32c.crc32c(head)))
                f.write(value)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    return len(entries)


def load_pool(pool: EmbeddedSnapshotPool, directory: str, *, wall_clock: Callable[[], float] = time.time) -> LoadResult:
    """Put the snapshots of ``directory/snapshots.embedded`` back into ``pool`` with the TTL they had left,
    then remove the file. Never raises for the file: absent is an empty result; unreadable, damaged or
    truncated is logged once (WARNING) and counted in ``corrupt``, keeping the records before the damage.
    Mutates ``pool`` and removes the file."""
    path = os.path.join(directory, FILE_NAME)
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return LoadResult()
    except OSError as exc:
        log.warning("embedded snapshot pool file %s unreadable (%s); starting with an empty pool", path, exc)
        _unlink(path)
        return LoadResult(corrupt=1)
    records, problem = _parse(data)
    now = wall_clock()
    loaded = expired = refused = 0
    for expires_at, snap in sorted(records, key=lambda r: r[0]):  # expiry order (the pool's order)
        left = expires_at - now
        if left <= 0:
            expired += 1
        elif pool.restore_entry(snap.key, snap.payload, left):
            loaded += 1
        else:
            refused += 1
    if problem is not None:
        log.warning("embedded snapshot pool file %s is damaged (%s): %d snapshots before it loaded, the rest are "
                    "misses", path, problem, loaded + expired + refused)
    _unlink(path)
    return LoadResult(loaded, expired, int(problem is not None), refused)


def _parse(data: bytes) -> tuple[list[tuple[float, Snapshot]], str | None]:
    """The records of a file up to the first damage, and what the damage was (None: the whole file read)."""
    if len(data) < _FILE_HEADER.size:
        return [], "shorter than its header"
    magic, version = _FILE_HEADER.unpack_from(data)
    if magic != MAGIC or version != VERSION:
        return [], f"not a version-{VERSION} snapshot file"
    out: list[tuple[float, Snapshot]] = []
    at, view = _FILE_HEADER.size, memoryview(data)
    head_size = _RECORD.size + _CRC.size
    while at < len(data):
        if at + head_size > len(data):
            return out, f"truncated record header at byte {at}"
        expires_ms, length = _RECORD.unpack_from(data, at)
        (crc,) = _CRC.unpack_from(data, at + _RECORD.size)
        if crc != crc32c.crc32c(data[at : at + _RECORD.size]) or length > _MAX_VALUE:
            return out, f"bad record header at byte {at}"
        at += head_size
        if at + length > len(data):
            return out, f"truncated record at byte {at}"
        try:
            snap = Snapshot.decode(view[at : at + length])
        except SnapshotCorrupt as exc:
            return out, f"record at byte {at}: {exc}"
        out.append((expires_ms / 1000, Snapshot(snap.key, bytes(snap.payload))))
        at += length
    return out, None


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def discard_saved(directory: str, *, dry_run: bool = False) -> int:
    """Erase the saved pool in ``directory`` (``kv wipe`` of a stopped server: its snapshots hold the wiped
    tenants' window states): overwritten with zeros and fsynced, then unlinked and the directory fsynced, so the
    bytes leave the disk, not just the index. Returns its size (0 when there is none). OSError propagates."""
    path = os.path.join(directory, FILE_NAME)
    try:
        size = os.path.getsize(path)
    except FileNotFoundError:
        return 0
    if dry_run:
        return size
    with open(path, "r+b") as f:
        left = size
        while left:
            left -= f.write(bytes(min(left, 1 << 20)))
        f.flush()
        os.fsync(f.fileno())
    os.unlink(path)
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    return size
