"""SSD record format: the fixed header in front of every payload in a segment file, and its checksums.

A record is ``header || payload``; segments are nothing but records back to back. Byte map of the header
(all integers little-endian, ``struct`` format ``<4sHH16s16sIdII``, 60 bytes)::

    offset  size  field        meaning
    0       4     magic        b"FTKV"; lets a scan resynchronise after a damaged header
    4       2     version      RECORD_VERSION (2); any other value is refused, never guessed at
    6       2     flags        reserved, 0; a non-zero value is a corrupt (or future) record
    8       16    key          the BlockHash digest the payload belongs to
    24      16    tenant       the tenant tag the block was written under (kvstore/tenant.py)
    40      4     length       payload bytes (u32)
    44      8     created_at   f64 seconds on the store clock (wall time: it outlives the process)
    52      4     payload_crc  crc32c(payload)
    56      4     header_crc   crc32c(bytes 0..56 of this header)
    60      ...   payload      ``length`` opaque bytes (a block's byte image, 56,960 B in the real model)

Version 1 (44-byte header, no tenant: ``<4sHH16sIdII``, header_crc over bytes 0..40) is recognised, never
served: such a record cannot be attributed to a tenant, so deleting a tenant could not find it.
``decode_header`` raises ``LegacyRecord`` (a RecordCorrupt carrying the record's size) for an intact v1
header; a scan skips the record whole and counts it (``SegmentScan.legacy``), the store logs the count
at start-up, and the bytes are garbage that compaction, eviction, ``kv wipe`` or a tenant deletion
reclaims.

Why two checksums: the header checksum lets a start-up scan trust ``length`` (and so find the next record)
after reading 44 bytes, without reading the payload; a torn or flipped header is detected before its
length is believed. The payload checksum is verified on every read, so a damaged payload is a miss and
never served. ``header_crc`` covers ``key`` and ``payload_crc``, which binds the payload to its key.

Pure functions, no I/O, no state: safe from any thread.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass

import crc32c

from flashtier.kvstore.block_hash import DIGEST_BYTES, BlockHash
from flashtier.kvstore.tenant import DEFAULT_TENANT_TAG, TAG_BYTES

MAGIC = b"FTKV"
RECORD_VERSION = 2
HEADER_FORMAT = "<4sHH16s16sIdII"
_HEADER = struct.Struct(HEADER_FORMAT)
HEADER_BYTES = _HEADER.size  # 60
_CRC_SPAN = HEADER_BYTES - 4  # header_crc covers everything before itself
MAX_PAYLOAD_BYTES = 0xFFFF_FFFF
LEGACY_VERSION = 1
_LEGACY_HEADER = struct.Struct("<4sHH16sIdII")  # version 1: no tenant
LEGACY_HEADER_BYTES = _LEGACY_HEADER.size  # 44
assert HEADER_BYTES == 60 and DIGEST_BYTES == 16 and TAG_BYTES == 16 and LEGACY_HEADER_BYTES == 44


class RecordCorrupt(ValueError):
    """Bytes that are not a valid record header (or a payload that fails its checksum)."""


class LegacyRecord(RecordCorrupt):
    """An intact version-1 header: a record without a tenant, skipped whole (``record_bytes`` long)."""

    def __init__(self, record_bytes: int) -> None:
        super().__init__(f"record version {LEGACY_VERSION} (no tenant; this build reads {RECORD_VERSION}): dropped")
        self.record_bytes = record_bytes


@dataclass(frozen=True, slots=True)
class RecordHeader:
    """A decoded, checksum-verified header."""

    key: BlockHash
    length: int  # payload bytes
    created_at: float  # seconds on the store clock
    payload_crc: int
    tenant: bytes = DEFAULT_TENANT_TAG  # tenant tag (kvstore/tenant.py)

    @property
    def record_bytes(self) -> int:
        """Header plus payload: the bytes this record occupies in its segment."""
        return HEADER_BYTES + self.length


def payload_crc(payload: bytes | bytearray | memoryview) -> int:
    return crc32c.crc32c(payload)


def encode_record(key: BlockHash, payload: bytes | bytearray | memoryview, created_at: float,
                  tenant: bytes = DEFAULT_TENANT_TAG) -> bytes:
    """``header || payload`` as one bytes object, ready for a single append; ``tenant`` is the tag of the
    tenant the block belongs to (kvstore/tenant.py; default: the default tenant).

    ValueError for a key that is not a BlockHash, a tenant that is not 16 bytes, a non-finite
    ``created_at`` or a payload over 4 GiB.
    """
    if not isinstance(tenant, bytes) or len(tenant) != TAG_BYTES:
        raise ValueError(f"an SSD record tenant is a {TAG_BYTES}-byte tag, got {tenant!r}")
    if not isinstance(key, BlockHash):
        raise ValueError(f"an SSD record key must be a BlockHash, got {type(key).__name__}")
    if not isinstance(payload, (bytes, bytearray, memoryview)):
        raise ValueError(f"an SSD record payload must be bytes-like, got {type(payload).__name__}")
    view = memoryview(payload).cast("B")
    if view.nbytes > MAX_PAYLOAD_BYTES:
        raise ValueError(f"payload of {view.nbytes} B exceeds the record limit of {MAX_PAYLOAD_BYTES} B")
    if not math.isfinite(created_at):
        raise ValueError(f"created_at must be a finite number of seconds, got {created_at!r}")
    head = _HEADER.pack(MAGIC, RECORD_VERSION, 0, key.digest, tenant, view.nbytes, float(created_at), payload_crc(view), 0)
    head = head[:_CRC_SPAN] + struct.pack("<I", crc32c.crc32c(head[:_CRC_SPAN]))
    return head + view.tobytes()


def decode_header(buf: bytes | bytearray | memoryview) -> RecordHeader:
    """Parse and verify the first HEADER_BYTES of ``buf``.

    Failure: RecordCorrupt naming the first check that failed (short buffer, magic, header checksum,
    version, flags). The checksum is checked before version and flags, so a damaged header reads as
    damaged rather than as a future version. An intact version-1 header raises ``LegacyRecord``.
    """
    if len(buf) >= LEGACY_HEADER_BYTES and bytes(buf[:4]) == MAGIC:
        _legacy_check(buf)
    if len(buf) < HEADER_BYTES:
        raise RecordCorrupt(f"record header needs {HEADER_BYTES} B, got {len(buf)}")
    magic, version, flags, key, tenant, length, created_at, p_crc, h_crc = _HEADER.unpack_from(buf, 0)
    if magic != MAGIC:
        raise RecordCorrupt(f"bad record magic {magic!r}")
    if crc32c.crc32c(memoryview(buf)[:_CRC_SPAN]) != h_crc:
        raise RecordCorrupt("record header checksum mismatch")
    if version != RECORD_VERSION:
        raise RecordCorrupt(f"unsupported record version {version} (this build reads {RECORD_VERSION})")
    if flags != 0:
        raise RecordCorrupt(f"unknown record flags {flags:#06x}")
    if not math.isfinite(created_at):
        raise RecordCorrupt(f"non-finite created_at {created_at!r}")
    return RecordHeader(BlockHash(key), length, created_at, p_crc, tenant)


def _legacy_check(buf: bytes | bytearray | memoryview) -> None:
    """LegacyRecord when ``buf`` starts with an intact version-1 header (its own 44-byte checksum holds)."""
    magic, version, flags, _key, length, created_at, _p_crc, h_crc = _LEGACY_HEADER.unpack_from(buf, 0)
    if version != LEGACY_VERSION or flags != 0 or not math.isfinite(created_at):
        return
    if crc32c.crc32c(memoryview(buf)[: LEGACY_HEADER_BYTES - 4]) == h_crc:
        raise LegacyRecord(LEGACY_HEADER_BYTES + length)


def decode_record(buf: bytes | bytearray | memoryview, key: BlockHash | None = None) -> bytes:
    """The verified payload of the one record that starts at ``buf[0]`` (``buf`` may run past its end).

    ``key`` (optional) must match the header's key: a record found where the index expected another key
    is as wrong as a damaged one. Failure: RecordCorrupt (bad header, short buffer, key or payload
    checksum mismatch); the payload is never returned unverified.
    """
    header = decode_header(buf)
    if key is not None and header.key != key:
        raise RecordCorrupt(f"record holds key {header.key.hex()}, expected {key.hex()}")
    end = header.record_bytes
    if len(buf) < end:
        raise RecordCorrupt(f"record needs {end} B, only {len(buf)} present")
    payload = memoryview(buf)[HEADER_BYTES:end]
    if payload_crc(payload) != header.payload_crc:
        raise RecordCorrupt("record payload checksum mismatch")
    return payload.tobytes()
