"""SSDStore.delete_tenant on a running store: the tenant's records (live and superseded) leave the index and
every segment file; the other tenants' entries are served byte for byte with their created_at unchanged
(their lifetime guarantee holds); queued writes of the tenant are dropped by the writer.

The marker is a payload pattern only the deleted tenant wrote; every file under the directory is searched
for it before (found: the check can fail) and after the deletion.
"""

from __future__ import annotations

import time

from flashtier.kvstore.ssd.put_result import PutResult
from flashtier.kvstore.ssd.writer import SSDWriter
from flashtier.kvstore.tenant import DEFAULT_TENANT_TAG, api_key_tenant, tenant_tag

from .ssd_store_support import HOUR, LIFETIME, P, clock, key, open_store, payload  # noqa: F401 - fixtures

GONE = tenant_tag(api_key_tenant("sk-gone"))
KEPT = tenant_tag("acme")
MARK = b"GONE-TENANT-MARK"  # 16 bytes


def marked() -> bytes:
    return (MARK * (P // len(MARK) + 1))[:P]


def files_holding(directory, needle: bytes) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.is_file() and needle in p.read_bytes())


def test_delete_tenant_removes_its_bytes_and_keeps_the_others(open_store, clock, tmp_path):
    s = open_store(budget=40 * 100)
    owners = {}
    for i in range(10):
        t = (GONE, KEPT, DEFAULT_TENANT_TAG)[i % 3]
        owners[i] = t
        assert s.put(key(i), marked() if t == GONE else payload(key(i)), t) is PutResult.STORED
        clock.advance(HOUR)
    assert s.put(key(0), marked(), GONE) is PutResult.STORED  # supersedes: the first copy is dead bytes
    assert s.flush()
    clock.advance(60 * HOUR)  # others are 61..70 h old: still young (72 h lifetime), never dropped
    before = {i: (s.get(key(i)), s.entry(key(i)).created_at) for i in owners if owners[i] != GONE}
    assert len(files_holding(tmp_path / "ssd", MARK)) >= 2

    started = time.perf_counter()
    result = s.delete_tenant(GONE)
    elapsed = time.perf_counter() - started
    assert (result.records_deleted, result.live_deleted) == (5, 4)
    assert files_holding(tmp_path / "ssd", MARK) == []
    s.check_integrity(deep=True)
    for i, t in owners.items():
        if t == GONE:
            assert s.get(key(i)) is None and key(i) not in s
        else:
            assert (s.get(key(i)), s.entry(key(i)).created_at) == before[i]
    assert s.stats().tenant_deletions == 1 and s.stats().tenant_records_deleted == 5
    assert s.delete_tenant(GONE).records_deleted == 0  # idempotent
    print(f"online delete of 5 records, {result.segments_rewritten} segments rewritten: {elapsed * 1000:.1f} ms")

    s.close()
    s2 = open_store(budget=40 * 100)  # a restart finds the same: the deletion was durable
    assert all((s2.get(key(i)) is None) == (t == GONE) for i, t in owners.items())


def test_writer_discards_queued_blocks_of_the_tenant(open_store):
    s = open_store()
    w = SSDWriter(s)
    try:
        gate = s.put  # hold the worker: the queue keeps what is submitted while the first put waits
        import threading
        release, entered = threading.Event(), threading.Event()

        def held(k, p, tenant=DEFAULT_TENANT_TAG):
            entered.set()
            release.wait(10)
            return gate(k, p, tenant)

        s.put = held
        first = w.submit(key(100), payload(key(100)), KEPT)
        assert entered.wait(10)
        gone = w.submit(key(1), marked(), GONE)
        kept = w.submit(key(2), payload(key(2)), KEPT)
        assert w.discard_tenant(GONE) == 1
        release.set()
        assert gone.result(10) is PutResult.DROPPED
        assert first.result(10) is PutResult.STORED and kept.result(10) is PutResult.STORED
        assert key(1) not in s and key(2) in s
    finally:
        w.close()
