"""``flashtier kv wipe --namespace NS | --api-key KEY`` on a stopped server's directory: one tenant's bytes
leave every file, the other tenants' entries are served as before (same created_at, same bytes).

The tier is written by a real SSDStore (fsync'd segment files): three tenants (the API key's, the
namespace "acme", the default one) interleaved in every segment, plus a superseded (dead) record of
the key's tenant, plus a stored conversation of each owner in ``KV_DIR/responses``. The marker is a
payload pattern and a conversation text that only the deleted tenant wrote; every file under the
directory is searched for both before (they are found: the check can fail) and after the wipe.
"""

from __future__ import annotations

import asyncio
import json
import struct
import time
from pathlib import Path

import crc32c
import xxhash

from flashtier.kvstore.block_hash import BlockHash
from flashtier.kvstore.config import KVStoreConfig
from flashtier.kvstore.snapshot.persist import FILE_NAME as SAVED_POOL
from flashtier.kvstore.ssd.record import HEADER_BYTES
from flashtier.kvstore.ssd.store import SSDStore
from flashtier.kvstore.tenant import DEFAULT_TENANT_TAG, api_key_tenant, tenant_tag
from flashtier.server.cli import main
from flashtier.server.response_store.disk_store import DiskResponseStore
from flashtier.server.response_store.owner import response_owner
from flashtier.server.response_store.store import StoredResponse

P = 1000
REC = HEADER_BYTES + P
KEY = "sk-tenant-to-delete"
MARK = b"MARKER-of-the-deleted-tenant!!!!"  # 32 bytes, repeated in each of its payloads
TEXT = "the secret conversation of the deleted tenant"


def key(i: int) -> BlockHash:
    return BlockHash(xxhash.xxh3_128_digest(i.to_bytes(8, "little")))


def payload(i: int, tenant: bytes) -> bytes:
    if tenant == tenant_tag(api_key_tenant(KEY)):
        return (MARK * (P // len(MARK) + 1))[:P]
    return (xxhash.xxh3_128_digest(b"p" + i.to_bytes(8, "little")) * (P // 16 + 1))[:P]


def config(kv_dir: Path) -> KVStoreConfig:
    return KVStoreConfig(ssd_dir=str(kv_dir), ssd_budget_bytes=64 * REC, ssd_segment_bytes=4 * REC,
                         ssd_lifetime_s=72 * 3600.0, ssd_refresh_age_s=24 * 3600.0)


def tenants() -> list[bytes]:
    return [tenant_tag(api_key_tenant(KEY)), tenant_tag("acme"), DEFAULT_TENANT_TAG]


def write_tier(kv_dir: Path) -> dict[int, bytes]:
    """12 records, tenants round-robin (each segment holds all three); key 0 written twice (one dead)."""
    owners = {}
    now = time.time()
    with SSDStore(config(kv_dir), clock=lambda: now - 3600.0) as store:
        for i in range(12):
            t = tenants()[i % 3]
            owners[i] = t
            assert store.put(key(i), payload(i, t), t).ok
        assert store.put(key(0), payload(0, owners[0]), owners[0]).ok  # supersedes the first copy: dead bytes
        assert store.flush()

    async def conversations() -> None:
        disk = DiskResponseStore(kv_dir)
        for n, owner in enumerate([response_owner(KEY), response_owner("sk-other"), None]):
            text = TEXT if owner == response_owner(KEY) else f"another conversation {n}"
            rid = f"resp_{n:032x}"
            assert await disk.put(StoredResponse({"id": rid, "output": []}, [{"role": "user", "content": text}],
                                                 owner))
        await disk.close()

    asyncio.run(conversations())
    return owners


def files_holding(kv_dir: Path, needle: bytes) -> list[str]:
    return sorted(str(p.relative_to(kv_dir)) for p in kv_dir.rglob("*") if p.is_file() and needle in p.read_bytes())


def run(capsys, *argv: str) -> tuple[int, str]:
    code = main(["kv", *argv])
    out, _ = capsys.readouterr()
    return code, out


def test_wipe_api_key_removes_its_bytes_from_every_file_and_keeps_the_others(tmp_path, capsys):
    kv_dir = tmp_path / "kv"
    owners = write_tier(kv_dir)
    with SSDStore(config(kv_dir)) as store:
        before = {i: (store.get(key(i)), store.entry(key(i)).created_at) for i in range(12)}
    # the embedded snapshot pool a clean stop saved (kvstore/snapshot/persist.py), holding the tenant's window
    (kv_dir / SAVED_POOL).write_bytes(b"FTSP" + MARK * 3)
    assert len(files_holding(kv_dir, MARK)) == 5  # every segment and the saved pool: the search can fail
    assert files_holding(kv_dir, TEXT.encode()) != []

    code, out = run(capsys, "stats", "--kv-dir", str(kv_dir), "--json")
    r = json.loads(out)
    by_tag = {n["tag"]: (n["entries"], n["records"]) for n in r["namespaces"]}
    assert by_tag[tenants()[0].hex()] == (4, 5) and by_tag[tenants()[1].hex()] == (4, 4)
    assert r["responses"]["records"] == 3

    code, out = run(capsys, "wipe", "--kv-dir", str(kv_dir), "--api-key", KEY, "--dry-run")
    assert code == 0 and "would remove 5 records" in out and "1 stored conversations" in out
    assert len(files_holding(kv_dir, MARK)) == 5  # a dry run changes nothing

    started = time.perf_counter()
    code, out = run(capsys, "wipe", "--kv-dir", str(kv_dir), "--api-key", KEY, "--yes")
    elapsed = time.perf_counter() - started
    assert code == 0 and "removed 5 records" in out and "removed 1 stored conversations" in out, out
    assert "saved snapshot pool" in out and not (kv_dir / SAVED_POOL).exists()
    assert files_holding(kv_dir, MARK) == [] and files_holding(kv_dir, TEXT.encode()) == []
    assert files_holding(kv_dir, b"another conversation 1") != []  # other owners' conversations stay
    print(f"offline wipe of 5 records + 1 conversation: {elapsed * 1000:.1f} ms")

    with SSDStore(config(kv_dir)) as store:
        store.check_integrity(deep=True)
        for i in range(12):
            if owners[i] == tenants()[0]:
                assert store.get(key(i)) is None  # the deleted tenant's next turn is cold
            else:  # served byte for byte, lifetime unchanged
                assert (store.get(key(i)), store.entry(key(i)).created_at) == before[i]
    code, out = run(capsys, "verify", "--kv-dir", str(kv_dir))
    assert code == 0 and tenants()[0].hex() not in out


def test_wipe_namespace_drops_version_1_records_and_keeps_other_namespaces(tmp_path, capsys):
    kv_dir = tmp_path / "kv"
    owners = write_tier(kv_dir)
    # a version-1 record (no tenant) appended to segment 1: recognised, never served, dropped by the wipe
    v1 = struct.pack("<4sHH16sIdI", b"FTKV", 1, 0, key(99).digest, 64, time.time(), crc32c.crc32c(b"L" * 64))
    v1 += struct.pack("<I", crc32c.crc32c(v1)) + b"L" * 64
    with open(kv_dir / "000000000001.seg", "ab") as f:
        f.write(v1)
    code, out = run(capsys, "stats", "--kv-dir", str(kv_dir), "--json")
    assert json.loads(out)["legacy_records"] == 1 and json.loads(out)["damaged_bytes"] == 0
    with SSDStore(config(kv_dir)) as store:
        assert store.get(key(99)) is None and store.stats().legacy_records == 1
    code, out = run(capsys, "wipe", "--kv-dir", str(kv_dir), "--namespace", "acme", "--yes")
    assert code == 0 and "removed 4 records" in out, out
    assert files_holding(kv_dir, b"L" * 64) == []
    with SSDStore(config(kv_dir)) as store:
        assert [i for i in range(12) if store.get(key(i)) is None] == [i for i in range(12)
                                                                         if owners[i] == tenants()[1]]


def test_wipe_all_removes_stored_conversations_too(tmp_path, capsys):
    kv_dir = tmp_path / "kv"
    write_tier(kv_dir)
    code, out = run(capsys, "wipe", "--kv-dir", str(kv_dir), "--all", "--yes")
    assert code == 0 and "removed 3 stored conversations" in out
    assert list((kv_dir / "responses").glob("*.json")) == []
    assert files_holding(kv_dir, TEXT.encode()) == [] and files_holding(kv_dir, MARK) == []
