"""Provenance of snapshots: a replayed (approximate) window state is stored under the replayed
namespace, never where an exact one is; lookups prefer exact snapshots and only take a replayed one
when allowed and no exact one is there. Real embedded snapshot pool; no model."""

import asyncio
import struct
from dataclasses import dataclass, field

from flashtier.engine.tiers.snapshot_codec import MAGIC, VERSION
from flashtier.engine.tiers.snapshot_search import SnapshotQuery, find_snapshot
from flashtier.engine.tiers.client import TierClient
from flashtier.kvstore.block_hash import hash_blocks, replayed_namespace
from flashtier.kvstore.snapshot.key import SnapshotKey
from flashtier.kvstore.snapshot.pool import EmbeddedSnapshotPool

from .scheduler_harness import NAMESPACE, Harness, prompt_of

PROMPT = prompt_of(60)
HASHES = hash_blocks(NAMESPACE, PROMPT, 4)


@dataclass
class RecordingTiers:
    """Stands in for TierManager: records the snapshot keys put."""

    keys: list[SnapshotKey] = field(default_factory=list)

    def put_snapshot(self, key, payload, on_stored=None):
        self.keys.append(key)


def _seq_at(h: Harness, point: int, enc_start: int):
    req = h.add("r", PROMPT, max_tokens=1)
    seq = h.scheduler.new_sequence(req, 0)
    assert h.kvm.ensure_blocks(seq.kv, point)
    seq.kv.tokens, seq.kv.enc_start, seq.kv.write_from = PROMPT[:point], enc_start, point
    seq.hashes = HASHES[: point // 4]
    return req, seq


def test_replayed_states_go_under_the_replayed_namespace():
    h = Harness()
    tiers = RecordingTiers()
    client = TierClient(tiers, h.kvm)
    req, exact = _seq_at(h, 22, enc_start=0)
    client.snapshot(req, exact)
    exact.kv.enc_start = 4  # the same point, replayed from R = 20
    client.snapshot(req, exact)
    parent = HASHES[4]
    assert tiers.keys == [SnapshotKey.for_tail(NAMESPACE, parent, PROMPT[20:22]),
                          SnapshotKey.for_tail(replayed_namespace(NAMESPACE), parent, PROMPT[20:22])]
    assert tiers.keys[0] != tiers.keys[1]


def _pool_with(points: dict[str, list[int]]) -> EmbeddedSnapshotPool:
    """Snapshots whose payload names their namespace and point."""
    pool = EmbeddedSnapshotPool(ttl_s=60, budget_bytes=1 << 20)
    for which, ps in points.items():
        ns = NAMESPACE if which == "exact" else replayed_namespace(NAMESPACE)
        for p in ps:
            b = p // 4
            key = SnapshotKey.for_tail(ns, HASHES[b - 1] if b else NAMESPACE, PROMPT[b * 4 : p])
            assert asyncio.run(pool.put(key, f"{which}@{p}".encode()))
    return pool


def _find(pool, allow_replayed: bool):
    q = SnapshotQuery(NAMESPACE, replayed_namespace(NAMESPACE) if allow_replayed else None, PROMPT, HASHES, 4)
    found = asyncio.run(find_snapshot(pool, q, best_b=len(PROMPT) // 4))  # one boundary more than tiers asks
    return found.payload.decode() if found.payload else None


def test_lookups_prefer_exact_snapshots_and_take_replayed_ones_only_when_allowed():
    assert _find(_pool_with({"exact": [22], "replayed": [41]}), allow_replayed=True) == "exact@22"
    assert _find(_pool_with({"replayed": [41, 30]}), allow_replayed=True) == "replayed@41"
    assert _find(_pool_with({"replayed": [41]}), allow_replayed=False) is None
    assert _find(_pool_with({"exact": [44, 9]}), allow_replayed=False) == "exact@44"


def test_any_point_up_to_the_prompt_end_is_a_candidate():
    """P = n - 1 (less than a window before the end: its replay tail covers the decoder replay), and P = n
    (the same prompt again: a retry resumes from the first request's prompt-end snapshot)."""
    assert _find(_pool_with({"exact": [59, 30]}), allow_replayed=False) == "exact@59"
    assert _find(_pool_with({"exact": [60, 45]}), allow_replayed=False) == "exact@60"
    assert _find(_pool_with({"exact": [58], "replayed": [60]}), allow_replayed=True) == "exact@58"


def test_a_payload_of_an_older_codec_version_is_a_miss():
    pool = _pool_with({"exact": [22]})
    key = SnapshotKey.for_tail(NAMESPACE, HASHES[10 - 1], PROMPT[40:41])
    assert asyncio.run(pool.put(key, struct.pack("<4sI", MAGIC, VERSION - 1) + b"old"))
    q = SnapshotQuery(NAMESPACE, None, PROMPT, HASHES, 4)
    found = asyncio.run(find_snapshot(pool, q, best_b=14))
    assert (found.point, found.payload, found.listed) == (22, b"exact@22", True)  # 41 skipped, 22 taken
