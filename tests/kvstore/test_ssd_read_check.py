"""record_intact (the read path's zero-copy check) against decode_record (the record format's own decoder):
same verdict on intact records, on every single-byte flip, on truncation, on another key or length."""

import struct

import crc32c
import pytest
import xxhash

from flashtier.kvstore.block_hash import BlockHash
from flashtier.kvstore.ssd.read_check import record_intact
from flashtier.kvstore.ssd.record import HEADER_BYTES, RecordCorrupt, decode_record, encode_record

P = 56


def key(i: int) -> BlockHash:
    return BlockHash(xxhash.xxh3_128_digest(i.to_bytes(8, "little")))


def old_verdict(raw: bytes, k: BlockHash, length: int) -> bool:
    """What the reader accepted before: decode_record with the key, then the index's payload length."""
    try:
        return len(decode_record(raw, k)) == length
    except RecordCorrupt:
        return False


def new_verdict(raw: bytes | bytearray, k: BlockHash, length: int, at: int = 0) -> bool:
    view = memoryview(raw)
    return record_intact(view, at, view[at + HEADER_BYTES : at + HEADER_BYTES + length], k.digest, length)


def test_an_intact_record_passes_inside_a_larger_buffer():
    k = key(1)
    raw = encode_record(k, bytes(range(P)), 5.0)
    assert new_verdict(raw, k, P) and old_verdict(raw, k, P)
    buf = b"x" * 13 + raw + encode_record(key(2), b"y" * P, 6.0)
    assert new_verdict(buf, k, P, at=13) and new_verdict(buf, key(2), P, at=13 + len(raw))


@pytest.mark.parametrize("pos", range(HEADER_BYTES + P))
def test_every_single_byte_flip_is_rejected_like_decode_record(pos):
    k = key(7)
    raw = bytearray(encode_record(k, bytes(range(100, 100 + P)), 123.5))
    raw[pos] ^= 0x20
    assert new_verdict(raw, k, P) is False
    assert old_verdict(bytes(raw), k, P) is False


def test_other_key_other_length_and_truncation_are_rejected():
    k = key(3)
    raw = encode_record(k, b"z" * P, 1.0)
    assert not new_verdict(raw, key(4), P) and not old_verdict(raw, key(4), P)
    assert not new_verdict(raw, k, P - 1) and not old_verdict(raw, k, P - 1)
    view = memoryview(raw)
    for cut in (0, 10, HEADER_BYTES - 1, HEADER_BYTES, len(raw) - 1):
        assert not record_intact(view[:cut], 0, view[HEADER_BYTES:cut], k.digest, P)
        assert not old_verdict(raw[:cut], k, P)


def test_valid_checksums_over_bad_fields_are_rejected():
    """A record re-checksummed after a field was changed (a future version, flags, non-finite time)."""
    k = key(5)
    raw = bytearray(encode_record(k, b"p" * P, 2.0))
    for off, fmt, value in ((4, "<H", 2), (6, "<H", 1), (28, "<d", float("nan")), (28, "<d", float("inf"))):
        bad = bytearray(raw)
        struct.pack_into(fmt, bad, off, value)
        struct.pack_into("<I", bad, 40, crc32c.crc32c(bytes(bad[:40])))
        assert not new_verdict(bad, k, P) and not old_verdict(bytes(bad), k, P), (off, value)


def test_an_empty_payload_is_a_record_too():
    k = key(6)
    raw = encode_record(k, b"", 1.0)
    assert new_verdict(raw, k, 0) and old_verdict(raw, k, 0)


def test_the_checksums_keep_the_gil(monkeypatch):
    """Both crc32c calls pass gil_release_mode=0, also for a block-sized payload (the library releases the GIL
    from 32 KiB by default): a release per record lets a busy engine thread take the GIL, and the reader then
    waits up to a switch interval (5 ms) per record to get it back."""
    import flashtier.kvstore.ssd.read_check as check

    modes = []

    class Recording:
        @staticmethod
        def crc32c(data, value=0, gil_release_mode=-1):
            modes.append(gil_release_mode)
            return crc32c.crc32c(data, value, gil_release_mode)

    monkeypatch.setattr(check, "crc32c", Recording)
    k, n = key(8), 56960  # one block of the real geometry
    raw = encode_record(k, bytes(range(256)) * (n // 256) + bytes(n % 256), 3.0)
    assert new_verdict(raw, k, n)
    assert modes == [0, 0]
