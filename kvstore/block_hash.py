"""Chained content hashes of full token blocks: the one definition of a block's identity.

A block's hash covers its own tokens *and* everything before it, so equal hashes mean equal prefixes::

    h_root = H_ns("flashtier/ns/v1", fingerprint, cache_salt)      namespace_hash()
    h_0    = H(h_root, tokens[0 : B])                              hash_block()
    h_k    = H(h_{k-1}, tokens[k*B : (k+1)*B])                      hash_blocks() chains these
    tokens[n*B : len)  (trailing partial block)                    never hashed

``H`` is xxh3_128 (16-byte digests; a collision needs ~2^64 blocks) over a canonical byte encoding that
does not depend on the Python version or platform, because hashes outlive the process: they key SSD
records and Redis keys.

- block input:     parent digest (16 B) || token ids as int32 little-endian (4 B each)
- namespace input: b"flashtier/ns/v1\\0" || u32le(len) || fingerprint utf-8 || salt part, where the salt
  part is b"\\x00" for ``None`` and b"\\x01" || u32le(len) || salt utf-8 otherwise. Length prefixes make
  the encoding injective (("ab", "c") and ("a", "bc") differ; ``None`` and ``""`` differ).

The fingerprint must already pin everything that changes the bytes of a block (model config, weights
revision, KV formats, block size): the engine builds it, kvstore only hashes it. Per-tenant isolation
uses ``cache_salt``: two tenants with different salts never share a block, even for identical tokens.

Not covered yet: non-token inputs (image embeddings behind placeholder tokens) need an extra key per
block; until then, a request carrying images must use a salt unique to its images.
"""

from __future__ import annotations

import struct
import sys
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

import xxhash

DIGEST_BYTES = 16
_NS_TAG = b"flashtier/ns/v1\x00"
_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1
assert array("i").itemsize == 4, "token encoding needs a 4-byte C int"


@dataclass(frozen=True, slots=True)
class BlockHash:
    """A 16-byte chained digest; hashable, ordered by bytes, serialised as 32 lowercase hex chars."""

    digest: bytes

    def __post_init__(self) -> None:
        if not isinstance(self.digest, bytes) or len(self.digest) != DIGEST_BYTES:
            raise ValueError(f"BlockHash needs exactly {DIGEST_BYTES} bytes, got {self.digest!r}")

    def hex(self) -> str:
        return self.digest.hex()

    @classmethod
    def from_hex(cls, text: str) -> BlockHash:
        """Inverse of ``hex()``; ValueError on anything but 32 hex characters."""
        if len(text) != 2 * DIGEST_BYTES:
            raise ValueError(f"a BlockHash hex string has {2 * DIGEST_BYTES} characters, got {len(text)}: {text!r}")
        try:
            return cls(bytes.fromhex(text))
        except ValueError:
            raise ValueError(f"not a hex BlockHash: {text!r}") from None

    def __bytes__(self) -> bytes:
        return self.digest

    def __repr__(self) -> str:
        return f"BlockHash({self.hex()[:12]}…)"


def _len_prefixed(text: str) -> bytes:
    raw = text.encode("utf-8")
    return struct.pack("<I", len(raw)) + raw


def namespace_hash(fingerprint: str, cache_salt: str | None = None) -> BlockHash:
    """The root ``h_{-1}`` of every chain in one namespace (model fingerprint + optional tenant salt)."""
    if not isinstance(fingerprint, str) or not fingerprint:
        raise ValueError(f"the model fingerprint must be a non-empty string, got {fingerprint!r}")
    if cache_salt is not None and not isinstance(cache_salt, str):
        raise ValueError(f"cache_salt must be a string or None, got {type(cache_salt).__name__}")
    salt = b"\x00" if cache_salt is None else b"\x01" + _len_prefixed(cache_salt)
    return BlockHash(xxhash.xxh3_128_digest(_NS_TAG + _len_prefixed(fingerprint) + salt))


def replayed_namespace(namespace: BlockHash) -> BlockHash:
    """Where snapshots of *replayed* (approximate) window states of ``namespace`` live.

    A state computed by bounded replay must never be stored where an exact one is, nor looked up as
    exact: its snapshots use this derived root in their keys.
    """
    return BlockHash(xxhash.xxh3_128_digest(_NS_TAG + b"replayed\x00" + namespace.digest))


def fork_root(parent: BlockHash) -> BlockHash:
    """What the first block computed from a replayed (approximate) state hangs from instead of its exact
    parent ``parent`` (the previous block's hash or the namespace). Its chain, and every block after it,
    leaves the exact chain for good, so an approximate block is never found by an exact lookup."""
    return BlockHash(xxhash.xxh3_128_digest(_NS_TAG + b"replayed-fork\x00" + parent.digest))


def fork_chain(hashes: Sequence[BlockHash], namespace: BlockHash, token_ids: Sequence[int], block_size: int,
               at: int) -> list[BlockHash]:
    """``hashes[:at]`` (the exact chain), then blocks ``at``.. of ``token_ids`` on the replayed fork that
    leaves the exact chain at block ``at`` (see ``fork_root``)."""
    parent = hashes[at - 1] if at else namespace
    return list(hashes[:at]) + hash_blocks(fork_root(parent), token_ids[at * block_size :], block_size)


def _encode_tokens(token_ids: Sequence[int]) -> bytes:
    """int32 little-endian bytes of ``token_ids``; ValueError for ids outside int32."""
    try:
        arr = array("i", token_ids)
    except (OverflowError, TypeError) as exc:
        raise ValueError(f"token ids must be integers in [{_INT32_MIN}, {_INT32_MAX}]: {exc}") from None
    if sys.byteorder != "little":
        arr.byteswap()
    return arr.tobytes()


def hash_block(parent: BlockHash, tokens: Sequence[int]) -> BlockHash:
    """``H(parent, tokens)`` for one block. ``parent`` is the previous block's hash or the namespace root."""
    if not isinstance(parent, BlockHash):
        raise ValueError(f"parent must be a BlockHash (the namespace root for block 0), got {type(parent).__name__}")
    if len(tokens) == 0:
        raise ValueError("cannot hash an empty block")
    return BlockHash(xxhash.xxh3_128_digest(parent.digest + _encode_tokens(tokens)))


def hash_blocks(namespace: BlockHash, token_ids: Sequence[int], block_size: int) -> list[BlockHash]:
    """Hashes of every full block of ``token_ids``, chained from ``namespace``; a partial tail is skipped.

    Returns ``len(token_ids) // block_size`` hashes. To extend a request's chain later, pass its last
    hash as ``namespace`` and only the new full blocks' tokens.
    """
    if not isinstance(namespace, BlockHash):
        raise ValueError(f"namespace must be a BlockHash from namespace_hash(), got {type(namespace).__name__}")
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    n_full = len(token_ids) // block_size
    raw = _encode_tokens(token_ids[: n_full * block_size])
    stride = 4 * block_size
    out: list[BlockHash] = []
    parent = namespace.digest
    for k in range(n_full):
        parent = xxhash.xxh3_128_digest(parent + raw[k * stride : (k + 1) * stride])
        out.append(BlockHash(parent))
    return out
