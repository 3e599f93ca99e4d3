"""Snapshot: one encoder snapshot point (``SnapshotKey``) and its value bytes (header + opaque payload).

A snapshot point is where a request's encoder state was saved (prompt end, generation end, preemption)::

    tokens:  [ full block 0 | ... | full block k-1 | tail (tail_len < block_size tokens) ]
                                            ^ block_hash = h_{k-1}   (namespace root when k == 0)
    tail_hash = hash_block(block_hash, tail tokens)                   (= block_hash when tail_len == 0)

The payload (SWA rings, ratio-2 partial-group state, the replay tail of encoder outputs, the tail
block's global KV) is serialised by the engine; kvstore treats it as opaque bytes. This module is the
one owner of the snapshot key names and of the value byte format; the pools only move the bytes.

Redis key names (the ``{...}`` part is a Redis Cluster hash tag, so a point and its directory share a
slot and can be written in one MULTI)::

    ft:snap:{<ns hex>:<block hash hex>}:<tail_len>:<tail hash hex>    value (below), SET ... PX ttl
    ft:snapdir:{<ns hex>:<block hash hex>}                            hash {tail_len: tail hash hex}

Value format, all integers little-endian, 72-byte header then the payload::

    off  size  field
      0     4  magic  b"FTSS"
      4     2  version (u16) = 1
      6     2  header length (u16) = 72
      8    16  namespace digest
     24    16  last full block hash digest
     40     4  tail_len (u32)
     44    16  tail hash digest
     60     8  payload length (u64)
     68     4  crc32c (u32) of bytes [0, 68) followed by the payload
     72     n  payload

``Snapshot.decode`` checks every field and raises ``SnapshotCorrupt`` (a ValueError); the pools turn that
into a counted "corrupt" miss.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass

import crc32c

from flashtier.kvstore.block_hash import DIGEST_BYTES, BlockHash, hash_block

MAGIC = b"FTSS"
VERSION = 1
_HEADER = struct.Struct("<4sHH16s16sI16sQ")  # everything before the crc
_CRC = struct.Struct("<I")
HEADER_BYTES = _HEADER.size + _CRC.size  # 72
_TAIL_LEN_MAX = 2**32 - 1
_SNAP_PREFIX = "ft:snap:"
_DIR_PREFIX = "ft:snapdir:"


class SnapshotCorrupt(ValueError):
    """A stored snapshot value failed validation (bad magic/version/length/checksum, or the wrong key)."""


def _tag(namespace: BlockHash, block_hash: BlockHash) -> str:
    return "{" + namespace.hex() + ":" + block_hash.hex() + "}"


def directory_key(namespace: BlockHash, block_hash: BlockHash) -> str:
    """Redis key of the directory {tail_len: tail hash hex} of the points after ``block_hash``."""
    if not isinstance(namespace, BlockHash) or not isinstance(block_hash, BlockHash):
        raise ValueError("directory_key needs two BlockHash values (namespace root, last full block hash)")
    return _DIR_PREFIX + _tag(namespace, block_hash)


def namespace_patterns(namespace: BlockHash) -> tuple[str, str]:
    """Redis ``SCAN MATCH`` patterns of every point key and every directory key of ``namespace``: the
    namespace is the first half of the hash tag, so ``ft:snap:{<ns hex>:*`` and ``ft:snapdir:{<ns hex>:*``
    (braces are literal in Redis patterns, hex needs no escaping)."""
    if not isinstance(namespace, BlockHash):
        raise ValueError("namespace_patterns needs a BlockHash (a namespace root)")
    return f"{_SNAP_PREFIX}{{{namespace.hex()}:*", f"{_DIR_PREFIX}{{{namespace.hex()}:*"


@dataclass(frozen=True, slots=True)
class SnapshotKey:
    """Identity of one snapshot point; hashable, so the embedded pool uses it as a dict key."""

    namespace: BlockHash  # namespace_hash(fingerprint, cache_salt)
    block_hash: BlockHash  # hash of the last full block before the point (namespace root if none)
    tail_len: int  # tokens after that block, 0 <= tail_len < block_size (kvstore does not know block_size)
    tail_hash: BlockHash  # tail_hash_of(block_hash, tail tokens)

    def __post_init__(self) -> None:
        for name in ("namespace", "block_hash", "tail_hash"):
            if not isinstance(getattr(self, name), BlockHash):
                raise ValueError(f"SnapshotKey.{name} must be a BlockHash, got {type(getattr(self, name)).__name__}")
        t = self.tail_len
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t <= _TAIL_LEN_MAX:
            raise ValueError(f"SnapshotKey.tail_len must be an int in [0, 2**32), got {t!r}")

    @classmethod
    def for_tail(cls, namespace: BlockHash, block_hash: BlockHash, tail_tokens: Sequence[int]) -> SnapshotKey:
        """The key of the point ``tail_tokens`` after the full block ``block_hash`` (the usual constructor)."""
        return cls(namespace, block_hash, len(tail_tokens), tail_hash_of(block_hash, tail_tokens))

    def redis_key(self) -> str:
        return f"{_SNAP_PREFIX}{_tag(self.namespace, self.block_hash)}:{self.tail_len}:{self.tail_hash.hex()}"

    def directory_key(self) -> str:
        return directory_key(self.namespace, self.block_hash)

    @classmethod
    def parse(cls, key: str) -> SnapshotKey:
        """Inverse of ``redis_key()``; ValueError on anything else."""
        if not isinstance(key, str) or not key.startswith(_SNAP_PREFIX + "{"):
            raise ValueError(f"not a snapshot key: {key!r}")
        tag, sep, rest = key[len(_SNAP_PREFIX) + 1 :].partition("}:")
        ns_hex, _, block_hex = tag.partition(":")
        tail_len, _, tail_hex = rest.partition(":")
        if not sep or not tail_len.isdigit() or tail_len != str(int(tail_len)):
            raise ValueError(f"not a snapshot key: {key!r}")
        ns, block, tail = (BlockHash.from_hex(h) for h in (ns_hex, block_hex, tail_hex))
        out = cls(ns, block, int(tail_len), tail)
        if out.redis_key() != key:  # e.g. upper-case hex: only the canonical spelling is a key
            raise ValueError(f"not a canonical snapshot key: {key!r}")
        return out


def tail_hash_of(block_hash: BlockHash, tail_tokens: Sequence[int]) -> BlockHash:
    """Hash of the tail tokens chained on ``block_hash``; an empty tail is ``block_hash`` itself.

    A tail of exactly block_size tokens is a full block: callers identify that point by the block's own
    hash with ``tail_len == 0`` instead, so every point has one key.
    """
    return hash_block(block_hash, tail_tokens) if len(tail_tokens) else block_hash


@dataclass(frozen=True, slots=True)
class Snapshot:
    """One stored snapshot: its key and the engine's opaque payload."""

    key: SnapshotKey
    payload: bytes

    @property
    def nbytes(self) -> int:
        """Bytes of the encoded value (header + payload): what the pools store and budget."""
        return HEADER_BYTES + len(self.payload)

    def encode(self) -> bytes:
        """Header + payload (one copy of the payload)."""
        k = self.key
        head = _HEADER.pack(MAGIC, VERSION, HEADER_BYTES, k.namespace.digest, k.block_hash.digest,
                            k.tail_len, k.tail_hash.digest, len(self.payload))  # fmt: skip
        crc = crc32c.crc32c(self.payload, crc32c.crc32c(head))
        return b"".join((head, _CRC.pack(crc), self.payload))

    @classmethod
    def decode(cls, data: bytes | bytearray | memoryview, expected: SnapshotKey | None = None) -> Snapshot:
        """Parse and validate a value; ``expected`` also checks it is the value of that key.

        Raises ``SnapshotCorrupt`` for anything but a value ``encode()`` wrote (for ``expected``).
        """
        view = memoryview(data)
        if len(view) < HEADER_BYTES:
            raise SnapshotCorrupt(f"snapshot value of {len(view)} B is shorter than the {HEADER_BYTES} B header")
        magic, version, header_len, ns, block, tail_len, tail, payload_len = _HEADER.unpack_from(view)
        if magic != MAGIC:
            raise SnapshotCorrupt(f"bad snapshot magic {magic!r}")
        if version != VERSION or header_len != HEADER_BYTES:
            raise SnapshotCorrupt(f"unsupported snapshot version {version} (header {header_len} B)")
        if payload_len != len(view) - HEADER_BYTES:
            have = len(view) - HEADER_BYTES
            raise SnapshotCorrupt(f"snapshot header says {payload_len} payload bytes, the value has {have}")
        (crc,) = _CRC.unpack_from(view, _HEADER.size)
        payload = view[HEADER_BYTES:]
        if crc32c.crc32c(payload, crc32c.crc32c(view[: _HEADER.size])) != crc:
            raise SnapshotCorrupt("snapshot checksum mismatch")
        assert len(ns) == len(block) == len(tail) == DIGEST_BYTES
        key = SnapshotKey(BlockHash(ns), BlockHash(block), tail_len, BlockHash(tail))
        if expected is not None and key != expected:
            raise SnapshotCorrupt(f"snapshot value belongs to {key.redis_key()}, not {expected.redis_key()}")
        return cls(key, payload.tobytes())
