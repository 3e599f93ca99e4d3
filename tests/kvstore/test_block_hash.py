"""Chained block hashes: the byte encoding, chaining, namespaces, partial blocks, hex round trip."""

import struct

import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from flashtier.kvstore.block_hash import BlockHash, hash_block, hash_blocks, namespace_hash

NS = namespace_hash("tiny-test-model@rev0/bs4", None)


def test_encoding_is_pinned():
    """Hashes key records on disk: the encoding is a format, so pin it byte for byte."""
    ns_input = b"flashtier/ns/v1\x00" + struct.pack("<I", 1) + b"m" + b"\x01" + struct.pack("<I", 2) + b"t1"
    assert namespace_hash("m", "t1").digest == xxhash.xxh3_128_digest(ns_input)
    assert namespace_hash("m", None).digest == xxhash.xxh3_128_digest(ns_input[:21] + b"\x00")
    tokens = [1, 2, 129279, -1]
    expected = xxhash.xxh3_128_digest(NS.digest + struct.pack("<4i", *tokens))
    assert hash_block(NS, tokens).digest == expected
    assert namespace_hash("m", None).hex() == "51fc8829429aec43dccdb0fb4b31e9ec"


def test_deterministic_and_chained():
    tokens = list(range(10, 22))  # 3 blocks of 4
    hashes = hash_blocks(NS, tokens, 4)
    assert hashes == hash_blocks(NS, list(tokens), 4)
    h0 = hash_block(NS, tokens[0:4])
    h1 = hash_block(h0, tokens[4:8])
    h2 = hash_block(h1, tokens[8:12])
    assert hashes == [h0, h1, h2]
    assert len(set(hashes)) == 3


def test_same_block_tokens_at_different_positions_differ():
    hashes = hash_blocks(NS, [7, 7, 7, 7] * 3, 4)
    assert len(set(hashes)) == 3


def test_changing_an_earlier_token_changes_every_later_hash():
    tokens = list(range(40))
    base = hash_blocks(NS, tokens, 8)
    changed = list(tokens)
    changed[13] += 1  # inside block 1
    other = hash_blocks(NS, changed, 8)
    assert other[0] == base[0]
    assert all(a != b for a, b in zip(base[1:], other[1:]))


def test_partial_tail_block_is_not_hashed():
    tokens = list(range(130))
    hashes = hash_blocks(NS, tokens, 64)
    assert len(hashes) == 2
    assert hashes == hash_blocks(NS, tokens[:128], 64)
    assert hash_blocks(NS, tokens[:63], 64) == []
    assert hash_blocks(NS, [], 64) == []


def test_chain_extends_incrementally():
    tokens = list(range(100, 148))
    full = hash_blocks(NS, tokens, 8)
    head = hash_blocks(NS, tokens[:24], 8)
    assert head + hash_blocks(head[-1], tokens[24:], 8) == full


@pytest.mark.parametrize(
    "a, b",
    [
        (("m1", None), ("m2", None)),
        (("m", None), ("m", "")),
        (("m", "tenant-a"), ("m", "tenant-b")),
        (("ab", "c"), ("a", "bc")),
        (("m", "x"), ("mx", None)),
    ],
)
def test_namespaces_never_share_hashes(a, b):
    tokens = list(range(16))
    assert namespace_hash(*a) != namespace_hash(*b)
    ha, hb = hash_blocks(namespace_hash(*a), tokens, 8), hash_blocks(namespace_hash(*b), tokens, 8)
    assert not set(ha) & set(hb)


def test_block_hash_value_type():
    h = hash_block(NS, [1, 2, 3])
    assert BlockHash.from_hex(h.hex()) == h
    assert bytes(h) == h.digest and len(h.hex()) == 32
    assert {h: 1}[BlockHash(h.digest)] == 1
    with pytest.raises(AttributeError):
        h.digest = b"\x00" * 16  # frozen
    assert "BlockHash(" in repr(h)


@pytest.mark.parametrize("text", ["", "ab", "zz" * 16, "0" * 31, "0" * 34])
def test_from_hex_rejects_bad_strings(text):
    with pytest.raises(ValueError, match="BlockHash"):
        BlockHash.from_hex(text)


def test_bad_inputs_raise_value_error():
    with pytest.raises(ValueError, match="16 bytes"):
        BlockHash(b"short")
    with pytest.raises(ValueError, match="fingerprint"):
        namespace_hash("", None)
    with pytest.raises(ValueError, match="empty block"):
        hash_block(NS, [])
    with pytest.raises(ValueError, match="int32|integers"):
        hash_block(NS, [2**31])
    with pytest.raises(ValueError, match="integers"):
        hash_blocks(NS, [1.5] * 8, 8)
    with pytest.raises(ValueError, match="block_size"):
        hash_blocks(NS, [1, 2], 0)
    with pytest.raises(ValueError, match="namespace"):
        hash_blocks("not-a-hash", [1, 2], 1)
    with pytest.raises(ValueError, match="parent"):
        hash_block(b"\x00" * 16, [1])


tokens_st = st.lists(st.integers(0, 129279), min_size=4, max_size=40)


@settings(max_examples=200, deadline=None)
@given(a=tokens_st, b=tokens_st)
def test_different_token_lists_give_different_chains(a, b):
    """Chains agree exactly on the blocks before the first differing token and differ on every one after."""
    bs = 4
    ha, hb = hash_blocks(NS, a, bs), hash_blocks(NS, b, bs)
    first_diff = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    for k in range(min(len(ha), len(hb))):
        if (k + 1) * bs <= first_diff:
            assert ha[k] == hb[k]
        else:
            assert ha[k] != hb[k]
    assert len(set(ha)) == len(ha)
