"""SSD record format: the fixed header in front of every payload in a segment file, and its checksums.

A record is ``header || payload``; segments are nothing but records back to back. Byte map of the header
(all integers little-endian, ``struct`` format ``<4sHH16sIdII``, 44 bytes)::

    offset  size  field        meaning
    0       4     magic        b"FTKV"; lets a scan resynchronise after a damaged header
    4       2     version      RECORD_VERSION (1); any other value is refused, never guessed at
    6       2     flags        reserved, 0; a non-zero value is a corrupt (or future) record
    8       16    key          the BlockHash digest the payload belongs to
    24      4     length       payload bytes (u32)
    28      8     created_at   f64 seconds on the store clock (wall time: it outlives the process)
    36      4     payload_crc  crc32c(payload)
    40      4     header_crc   crc32c(bytes 0..40 of this header)
    44      ...   payload      ``length`` opaque bytes (a block's byte image, 56,960 B in the real model)

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

MAGIC = b"FTKV"
RECORD_VERSION = 1
_HEADER = struct.Struct("<4sHH16sIdII")
HEADER_BYTES = _HEADER.size  # 44
_CRC_SPAN = HEADER_BYTES - 4  # header_crc covers everything before itself
MAX_PAYLOAD_BYTES = 0xFFFF_FFFF
assert HEADER_BYTES == 44 and DIGEST_BYTES == 16


class RecordCorrupt(ValueError):
    """Bytes that are not a valid record header (or a payload that fails its checksum)."""


@dataclass(frozen=True, slots=True)
class RecordHeader:
    """A decoded, checksum-verified header."""

    key: BlockHash
    length: int  # payload bytes
    created_at: float  # seconds on the store clock
    payload_crc: int

    @property
    def record_bytes(self) -> int:
        """Header plus payload: the bytes this record occupies in its segment."""
        return HEADER_BYTES + self.length


def payload_crc(payload: bytes | bytearray | memoryview) -> int:
    return crc32c.crc32c(payload)


def encode_record(key: BlockHash, payload: bytes | bytearray | memoryview, created_at: float) -> bytes:
    """``header || payload`` as one bytes object, ready for a single append.

    ValueError for a key that is not a BlockHash, a non-finite ``created_at`` or a payload over 4 GiB.
    """
    if not isinstance(key, BlockHash):
        raise ValueError(f"an SSD record key must be a BlockHash, got {type(key).__name__}")
    if not isinstance(payload, (bytes, bytearray, memoryview)):
        raise ValueError(f"an SSD record payload must be bytes-like, got {type(payload).__name__}")
    view = memoryview(payload).cast("B")
    if view.nbytes > MAX_PAYLOAD_BYTES:
        raise ValueError(f"payload of {view.nbytes} B exceeds the record limit of {MAX_PAYLOAD_BYTES} B")
    if not math.isfinite(created_at):
        raise ValueError(f"created_at must be a finite number of seconds, got {created_at!r}")
    head = _HEADER.pack(MAGIC, RECORD_VERSION, 0, key.digest, view.nbytes, float(created_at), payload_crc(view), 0)
    head = head[:_CRC_SPAN] + struct.pack("<I", crc32c.crc32c(head[:_CRC_SPAN]))
    return head + view.tobytes()


def decode_header(buf: bytes | bytearray | memoryview) -> RecordHeader:
    """Parse and verify the first HEADER_BYTES of ``buf``.

    Failure: RecordCorrupt naming the first check that failed (short buffer, magic, header checksum,
    version, flags). The checksum is checked before version and flags, so a damaged header reads as
    damaged rather than as a future version.
    """
    if len(buf) < HEADER_BYTES:
        raise RecordCorrupt(f"record header needs {HEADER_BYTES} B, got {len(buf)}")
    magic, version, flags, key, length, created_at, p_crc, h_crc = _HEADER.unpack_from(buf, 0)
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
    return RecordHeader(BlockHash(key), length, created_at, p_crc)


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
