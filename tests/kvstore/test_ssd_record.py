"""SSD record format: the exact byte map, round trips, and that every damaged byte is detected."""

import struct

import crc32c
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flashtier.kvstore.block_hash import BlockHash
from flashtier.kvstore.tenant import DEFAULT_TENANT_TAG, tenant_tag
from flashtier.kvstore.ssd.record import (
    HEADER_BYTES,
    MAGIC,
    RECORD_VERSION,
    LegacyRecord,
    RecordCorrupt,
    decode_header,
    decode_record,
    encode_record,
)

KEY = BlockHash(bytes(range(16)))


def test_byte_map_is_fixed():
    tenant = tenant_tag("acme")
    raw = encode_record(KEY, b"hello", 1234.5, tenant)
    assert HEADER_BYTES == 60 and len(raw) == 60 + 5
    assert raw[0:4] == MAGIC == b"FTKV"
    assert struct.unpack_from("<HH", raw, 4) == (RECORD_VERSION, 0) == (2, 0)
    assert raw[8:24] == KEY.digest
    assert raw[24:40] == tenant
    assert struct.unpack_from("<I", raw, 40) == (5,)
    assert struct.unpack_from("<d", raw, 44) == (1234.5,)
    assert struct.unpack_from("<I", raw, 52) == (crc32c.crc32c(b"hello"),)
    assert struct.unpack_from("<I", raw, 56) == (crc32c.crc32c(raw[:56]),)
    assert raw[60:] == b"hello"
    assert decode_header(raw).tenant == tenant


def test_default_tenant():
    """A record put without a tenant belongs to the default tenant (requests without a cache_salt)."""
    assert decode_header(encode_record(KEY, b"x", 1.0)).tenant == DEFAULT_TENANT_TAG == tenant_tag(None)
    assert tenant_tag(None) != tenant_tag("") != tenant_tag("acme")
    with pytest.raises(ValueError, match="16-byte tag"):
        encode_record(KEY, b"x", 1.0, b"short")


def test_golden_record():
    """A frozen image: a change of format must be deliberate (and bump RECORD_VERSION)."""
    raw = encode_record(BlockHash(b"\x11" * 16), b"\x00\x01\x02", 1.0, b"\x22" * 16)
    assert raw.hex() == GOLDEN


GOLDEN = (
    "46544b56"  # magic "FTKV"
    "0200" "0000"  # version 2, flags 0
    "11111111111111111111111111111111"  # key
    "22222222222222222222222222222222"  # tenant tag
    "03000000"  # length 3
    "000000000000f03f"  # created_at 1.0 (f64 LE)
    "fa4bfd92"  # crc32c(payload)
    "ccc34096"  # crc32c(header bytes 0..56)
    "000102"  # payload
)

# The version-1 image (44-byte header, no tenant) that flashtier wrote before records carried their tenant.
GOLDEN_V1 = bytes.fromhex(
    "46544b56" "0100" "0000" "11111111111111111111111111111111" "03000000" "000000000000f03f" "fa4bfd92"
    "cbe9025c" "000102")


def test_version_1_is_recognised_never_read():
    """An intact v1 record is LegacyRecord with its exact size (a scan skips it whole), never a payload."""
    with pytest.raises(LegacyRecord) as info:
        decode_header(GOLDEN_V1 + bytes(32))
    assert info.value.record_bytes == 44 + 3
    with pytest.raises(RecordCorrupt):
        decode_record(GOLDEN_V1 + bytes(32))
    damaged = bytearray(GOLDEN_V1 + bytes(32))
    damaged[30] ^= 1  # its own checksum fails: plain damage, not a legacy record
    with pytest.raises(RecordCorrupt) as info:
        decode_header(damaged)
    assert not isinstance(info.value, LegacyRecord)


def test_round_trip_and_record_bytes():
    raw = encode_record(KEY, bytearray(b"xyz" * 10), 7.25)
    header = decode_header(raw)
    assert (header.key, header.length, header.created_at, header.record_bytes) == (KEY, 30, 7.25, 90)
    assert decode_record(raw, KEY) == b"xyz" * 10
    assert decode_record(raw + b"trailing bytes of the next record") == b"xyz" * 10
    assert decode_record(encode_record(KEY, b"", 0.0)) == b""


@pytest.mark.parametrize("pos", range(0, 60 + 8))
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
    with pytest.raises(RecordCorrupt, match="needs 60"):
        decode_header(raw[:43])
    with pytest.raises(RecordCorrupt, match="magic"):
        decode_header(b"XXXX" + raw[4:])
    future = bytearray(raw[:56])
    future[4:6] = struct.pack("<H", 3)
    future += struct.pack("<I", crc32c.crc32c(bytes(future)))
    with pytest.raises(RecordCorrupt, match="version 3"):
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
