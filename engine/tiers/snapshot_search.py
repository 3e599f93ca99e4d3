"""Find the best snapshot for a prompt of n tokens: the longest point P <= n, at or below ``best_b`` full
blocks, whose key is in the pool — exact snapshots first, then (if allowed) replayed ones.

    block boundaries   best_b, best_b - 1, ... (at most SNAPSHOT_SEARCH_BLOCKS of them)
    at boundary b      directory (namespace, hash of block b - 1) -> {tail length: tail hash}
    a point            P = b * bs + tail length, usable if its tail hash equals the prompt's tokens

Any P <= n will do, however close to n: the payload's replay tail holds the encoder outputs that the
decoder replay over [n - window, n) needs below P. P = n (the same prompt again: a retry, a regenerate,
n > 1 sent as separate requests) resumes from the earlier request's prompt-end snapshot and feeds no
encoder token at all: the decoder replay reads the whole tail. A payload of an older codec version is
skipped like an absent one (a miss).

Replayed (approximate) states are stored under ``replayed_namespace`` (never where an exact one is),
so a hit there resumes an approximate state and is reported as such (its payload carries enc_start).
"""

from __future__ import annotations

from dataclasses import dataclass

from flashtier.engine.tiers.snapshot_codec import is_stale
from flashtier.kvstore.block_hash import BlockHash
from flashtier.kvstore.snapshot.key import SnapshotKey
from flashtier.kvstore.snapshot.pool import SnapshotPool

SNAPSHOT_SEARCH_BLOCKS = 64  # how many block boundaries below the best candidate a lookup probes


@dataclass(frozen=True)
class SnapshotQuery:
    namespace: BlockHash  # root of the exact chain (the blocks' hashes hang from it)
    replayed_namespace: BlockHash | None  # where replayed states live; None: exact snapshots only
    prompt: list[int]
    hashes: list[BlockHash]  # chained hashes of the prompt's full blocks
    block_size: int


@dataclass(frozen=True)
class SnapshotFound:
    point: int | None  # None: nothing usable
    payload: bytes | None
    listed: bool  # some candidate point was listed (a miss rather than "none")
    failed: bool = False  # the pool failed or skipped calls meanwhile (an error rather than "none")


async def find_snapshot(pool: SnapshotPool, q: SnapshotQuery, best_b: int) -> SnapshotFound:
    """Exact snapshots first; replayed ones only when no exact one is there. Never raises for the pool
    (a failing pool answers empty directories and misses). ``failed`` compares the pool's failure
    counters before and after, so a concurrent lookup's failure may be attributed here too (it only
    labels the outcome)."""
    before = _failures(pool)
    found = await _search(pool, q, q.namespace, best_b)
    if found.point is None and q.replayed_namespace is not None:
        replayed = await _search(pool, q, q.replayed_namespace, best_b)
        found = SnapshotFound(replayed.point, replayed.payload, found.listed or replayed.listed)
    return SnapshotFound(found.point, found.payload, found.listed, _failures(pool) > before)


def _failures(pool: SnapshotPool) -> int:
    s = pool.stats()
    return s.redis_errors + sum(s.skipped_by_op.values())


async def _search(pool: SnapshotPool, q: SnapshotQuery, namespace: BlockHash, best_b: int) -> SnapshotFound:
    """Every candidate boundary's directory in one round trip (one deadline), then gets, best first."""
    bs, n = q.block_size, len(q.prompt)
    listed = False
    boundaries = list(range(best_b, max(-1, best_b - SNAPSHOT_SEARCH_BLOCKS), -1))
    parents = [q.hashes[b - 1] if b else q.namespace for b in boundaries]
    directories = await pool.points_many(namespace, parents)
    for b, parent, points in zip(boundaries, parents, directories):
        for tail_len in sorted(points, reverse=True):
            p = b * bs + tail_len
            if tail_len >= bs or p > n or p < 1:
                continue
            key = SnapshotKey.for_tail(namespace, parent, q.prompt[b * bs : p])
            if key.tail_hash.hex() != points[tail_len]:
                continue
            listed = True
            data = await pool.get(key)
            if data is not None and not is_stale(data):
                return SnapshotFound(p, data, True)
    return SnapshotFound(None, None, listed)
