"""SSD record format: the exact byte map, round trips, and that every damaged byte is detected."""

import struct

import crc32c
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flashtier.kvstore.block_hash import BlockHash
from flashtier.kvstore.ssd.record import (
    HEADER_BYTES,
    MAGIC,
    RECORD_VERSION,
    RecordCorrupt,
    decode_header,
    decode_record,
    encode_record,
)

KEY = BlockHash(bytes(range(16)))


def test_byte_map_is_fixed():
    raw = encode_record(KEY, b"hello", 1234.5)
    assert HEADER_BYTES == 44 and len(raw) == 44 + 5
    assert raw[0:4] == MAGIC == b"FTKV"
    assert struct.unpack_from("<HH", raw, 4) == (RECORD_VERSION, 0) == (1, 0)
    assert raw[8:24] == KEY.digest
    assert struct.unpack_from("<I", raw, 24) == (5,)
    assert struct.unpack_from("<d", raw, 28) == (1234.5,)
    assert struct.unpack_from("<I", raw, 36) == (crc32c.crc32c(b"hello"),)
    assert struct.unpack_from("<I", raw, 40) == (crc32c.crc32c(raw[:40]),)
    assert raw[44:] == b"hello"


def test_golden_record():
    """A frozen image: a change of format must be deliberate (and bump RECORD_VERSION)."""
    raw = encode_record(BlockHash(b"\x11" * 16), b"\x00\x01\x02", 1.0)
    assert raw.hex() == GOLDEN


GOLDEN = (
    "46544b56"  # magic "FTKV"
    "0100" "0000"  # version 1, flags 0
    "11111111111111111111111111111111"  # key
    "03000000"  # length 3
    "000000000000f03f"  # created_at 1.0 (f64 LE)
    "fa4bfd92"  # crc32c(payload)
    "cbe9025c"  # crc32c(header bytes 0..40)
    "000102"  # payload
)


def test_round_trip_and_record_bytes():
    raw = encode_record(KEY, bytearray(b"xyz" * 10), 7.25)
    header = decode_header(raw)
    assert (header.key, header.length, header.created_at, header.record_bytes) == (KEY, 30, 7.25, 74)
    assert decode_record(raw, KEY) == b"xyz" * 10
    assert decode_record(raw + b"trailing bytes of the next record") == b"xyz" * 10
    assert decode_record(encode_record(KEY, b"", 0.0)) == b""


@pytest.mark.parametrize("pos", range(0, 44 + 8))
def test_every_flipped_bit_is_detected(pos):
    raw = bytearray(encode_record(KEY, b"payload!", 3.0))
    for bit in range(8):
        bad = bytearray(raw)
        bad[pos] ^= 1 << bit
        with pytest.raises(RecordCorrupt):
            decode_record(bad, KEY)


def test_damaged_header_detected_without_payload():
    raw = bytearray(encode_record(KEY, b"p" * 100, 3.0))
    raw[24] ^= 0x40  # length field: the header checksum catches it before the length is believed
    with pytest.raises(RecordCorrupt, match="checksum"):
        decode_header(raw[:HEADER_BYTES])


def test_wrong_key_short_buffer_magic_and_version():
    raw = encode_record(KEY, b"abc", 1.0)
    with pytest.raises(RecordCorrupt, match="expected"):
        decode_record(raw, BlockHash(b"\xff" * 16))
    with pytest.raises(RecordCorrupt, match="needs"):
        decode_record(raw[:-1])
    with pytest.raises(RecordCorrupt, match="needs 44"):
        decode_header(raw[:43])
    with pytest.raises(RecordCorrupt, match="magic"):
        decode_header(b"XXXX" + raw[4:])
    future = bytearray(raw[:40])
    future[4:6] = struct.pack("<H", 2)
    future += struct.pack("<I", crc32c.crc32c(bytes(future)))
    with pytest.raises(RecordCorrupt, match="version 2"):
        decode_header(future)


def test_bad_arguments_raise_value_error():
    with pytest.raises(ValueError, match="BlockHash"):
        encode_record(b"\x00" * 16, b"", 0.0)
    with pytest.raises(ValueError, match="bytes-like"):
        encode_record(KEY, "text", 0.0)
    with pytest.raises(ValueError, match="finite"):
        encode_record(KEY, b"", float("nan"))


@settings(max_examples=200, deadline=None)
@given(st.binary(min_size=16, max_size=16), st.binary(max_size=300),
       st.floats(allow_nan=False, allow_infinity=False))  # fmt: skip
def test_round_trip_property(digest, payload, created_at):
    key = BlockHash(digest)
    raw = encode_record(key, payload, created_at)
    header = decode_header(raw)
    assert (header.key, header.length, header.created_at) == (key, len(payload), created_at)
    assert decode_record(raw, key) == payload
