"""record_intact: the read path's check that bytes read are the intact record an index entry describes.

It accepts exactly what ``decode_record(buf, key)`` accepts followed by the reader's length check (magic,
version, flags, key, length, a finite ``created_at``, both checksums), but works on views of a larger
read buffer: no ``RecordHeader`` or ``BlockHash`` is built and nothing is copied, so a restore of
thousands of records spends its time in the two crc32c calls, not in per-record Python objects. Both keep
the GIL (``gil_release_mode=0``): a block's crc takes microseconds, and releasing the GIL for it (the
library's default above 32 KiB) lets a busy engine thread take it, after which the reader waits a whole
switch interval (5 ms) to get it back, once per record. The header byte map is ssd/record.py's;
tests/kvstore/test_ssd_read_check.py holds the two checks to the same verdict on every byte flip.

Pure function; safe from any thread.
"""

from __future__ import annotations

import math
import struct

import crc32c

from flashtier.kvstore.ssd.record import HEADER_BYTES, HEADER_FORMAT, MAGIC, RECORD_VERSION

_HEADER = struct.Struct(HEADER_FORMAT)  # the layout ssd/record.py documents
_CRC_SPAN = HEADER_BYTES - 4  # header_crc covers everything before itself
assert _HEADER.size == HEADER_BYTES


def record_intact(head: bytes | bytearray | memoryview, at: int, payload: memoryview, digest: bytes,
                  length: int) -> bool:  # fmt: skip
    """True when the header at ``head[at : at + HEADER_BYTES]`` and ``payload`` form the intact record of
    key ``digest`` with a payload of ``length`` bytes; False for anything else (short or damaged bytes,
    another key or length, a future version). Never raises for bad bytes; reads only."""
    if len(head) - at < HEADER_BYTES or len(payload) != length:
        return False
    magic, version, flags, key, _tenant, n, created_at, p_crc, h_crc = _HEADER.unpack_from(head, at)
    return (magic == MAGIC and key == digest and n == length and version == RECORD_VERSION and flags == 0
            and math.isfinite(created_at)
            and crc32c.crc32c(memoryview(head)[at : at + _CRC_SPAN], gil_release_mode=0) == h_crc
            and crc32c.crc32c(payload, gil_release_mode=0) == p_crc)  # fmt: skip
