"""``flashtier kv stats | verify | wipe`` on SSD tiers written by a real SSDStore (in-process, fast).

The tier: 12 records of 1,060 B (60 B header + 1,000 B payload) in segments of 4 records (3 files), written
by an SSDStore whose clock says records 0-4 are 50 h old, 5-7 2 h old, 8-11 1 minute old (so the second
segment mixes ages). A byte flipped in a
payload must be found by ``verify`` (record, offset, key, live) and a byte flipped in a header must be
reported as a damaged range; the same tier before the flip verifies clean, so each check can fail. ``wipe``
must leave a tier that a fresh SSDStore reads back: kept records served byte for byte, removed ones
absent. A held SERVER.LOCK or store LOCK stops every command with one line and exit status 2.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import xxhash

from flashtier.kvstore.block_hash import BlockHash
from flashtier.kvstore.config import KVStoreConfig
from flashtier.kvstore.ssd.record import HEADER_BYTES
from flashtier.kvstore.ssd.store import SSDStore
from flashtier.server.cli import main
from flashtier.server.config.kv_dir_lock import KVDirInUse, KVDirLock

HOUR = 3600.0
P = 1000
REC = HEADER_BYTES + P
AGES_H = [50.0] * 5 + [2.0] * 3 + [1 / 60] * 4  # per record, in write order


def key(i: int) -> BlockHash:
    return BlockHash(xxhash.xxh3_128_digest(i.to_bytes(8, "little")))


def payload(i: int) -> bytes:
    return (xxhash.xxh3_128_digest(b"p" + i.to_bytes(8, "little")) * (P // 16 + 1))[:P]


def store_config(kv_dir: Path) -> KVStoreConfig:
    return KVStoreConfig(ssd_dir=str(kv_dir), ssd_budget_bytes=64 * REC, ssd_segment_bytes=4 * REC,
                         ssd_lifetime_s=72 * HOUR, ssd_refresh_age_s=24 * HOUR)


@pytest.fixture
def tier(tmp_path) -> Path:
    """A closed tier of 12 records in 3 segments; ``now`` is the wall clock (the tools read it)."""
    kv_dir = tmp_path / "kv"
    now = time.time()
    ages = iter(AGES_H)
    current = {"t": now}
    with SSDStore(store_config(kv_dir), clock=lambda: current["t"]) as store:
        for i in range(12):
            current["t"] = now - next(ages) * HOUR
            assert store.put(key(i), payload(i)).ok
        assert store.flush()
    return kv_dir


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(["kv", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def segments(kv_dir: Path) -> list[Path]:
    return sorted(kv_dir.glob("*.seg"))


def flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x5A]))


def read_back(kv_dir: Path) -> dict[int, bytes | None]:
    with SSDStore(store_config(kv_dir)) as store:
        store.check_integrity(deep=True)
        return {i: store.get(key(i)) for i in range(12)}


def test_stats_reports_entries_bytes_ages_and_budget(tier, capsys):
    code, out, _ = run(capsys, "stats", "--kv-dir", str(tier), "--kv-disk-budget", "1M", "--kv-lifetime", "24h",
                       "--json")
    assert code == 0
    r = json.loads(out)
    assert (r["segments"], r["entries"], r["live_bytes"], r["bytes_on_disk"]) == (3, 12, 12 * REC, 12 * REC)
    assert (r["dead_bytes"], r["damaged_bytes"], r["torn_bytes"]) == (0, 0, 0)
    assert r["budget_bytes"] == 1 << 20 and r["lifetime_s"] == 24 * HOUR
    assert r["young_bytes"] == 7 * REC and r["expired_bytes"] == 5 * REC  # 50 h old > 24 h lifetime
    assert 50 * HOUR <= r["oldest_age_s"] < 50 * HOUR + 60 and r["newest_age_s"] < 120
    by_edge = {b["high_s"]: b["entries"] for b in r["ages"]}
    assert by_edge == {300.0: 4, 3600.0: 0, 6 * HOUR: 3, 24 * HOUR: 0, None: 5}
    assert [(n["default"], n["entries"], n["live_bytes"]) for n in r["namespaces"]] == [(True, 12, 12 * REC)]
    assert r["responses"]["records"] == 0
    code, text, _ = run(capsys, "stats", "--kv-dir", str(tier))  # the human form, serve's defaults (512G, 72h)
    assert code == 0 and "12 live" in text and "512G" in text and ">= 3d (expired)" in text


def test_stats_takes_the_budget_from_the_servers_variable(tier, capsys, monkeypatch):
    monkeypatch.setenv("FLASHTIER_KV_DIR", str(tier))
    monkeypatch.setenv("FLASHTIER_KV_DISK_BUDGET", "2M")
    code, out, _ = run(capsys, "stats", "--json")
    assert code == 0 and json.loads(out)["budget_bytes"] == 2 << 20
    monkeypatch.setenv("FLASHTIER_KV_DISK_BUDGET", "lots")
    code, _, err = run(capsys, "stats")
    assert code == 2 and err.startswith("flashtier: error: FLASHTIER_KV_DISK_BUDGET='lots'") and err.count("\n") == 1


def test_verify_finds_a_byte_flipped_in_a_payload(tier, capsys):
    code, out, _ = run(capsys, "verify", "--kv-dir", str(tier), "--json")
    assert code == 0 and json.loads(out)["records"] == 12 and json.loads(out)["bad"] == []
    second = segments(tier)[1]  # records 4..7; record 6 starts at 2 * REC
    flip(second, 2 * REC + HEADER_BYTES + 500)
    code, out, _ = run(capsys, "verify", "--kv-dir", str(tier), "--json")
    r = json.loads(out)
    assert code == 1 and r["records"] == 12
    assert r["bad"] == [{"segment_id": 2, "offset": 2 * REC, "bytes": REC, "key": key(6).hex(), "live": True,
                         "reason": "record payload checksum mismatch"}]
    code, text, _ = run(capsys, "verify", "--kv-dir", str(tier))
    assert code == 1 and "1 BAD" in text and key(6).hex() in text and "future miss" in text


def test_verify_reports_a_damaged_header_as_a_range_and_a_torn_tail_as_no_damage(tier, capsys):
    first, _, third = segments(tier)
    flip(first, REC + 10)  # record 1's key bytes: its header checksum fails, the scan skips to record 2
    with open(third, "ab") as f:
        f.write(b"FTKV" + b"\x00" * 10)  # a header cut short: a torn tail
    code, out, _ = run(capsys, "verify", "--kv-dir", str(tier), "--json")
    r = json.loads(out)
    assert code == 1 and r["records"] == 11
    assert r["bad"] == [{"segment_id": 1, "offset": REC, "bytes": REC, "key": None, "live": False,
                         "reason": "damaged record header"}]
    assert r["torn"] == [{"segment_id": 3, "offset": 4 * REC, "bytes": 14}]
    code, out, _ = run(capsys, "stats", "--kv-dir", str(tier), "--json")
    assert json.loads(out)["damaged_bytes"] == REC and json.loads(out)["torn_bytes"] == 14


def test_wipe_older_than_rewrites_mixed_segments_and_keeps_the_rest_readable(tier, capsys):
    before = [p.name for p in segments(tier)]
    code, out, _ = run(capsys, "wipe", "--kv-dir", str(tier), "--older-than", "1h", "--dry-run", "--json")
    assert code == 0 and json.loads(out)["records_removed"] == 8
    assert [p.name for p in segments(tier)] == before  # a dry run changes nothing
    code, _, err = run(capsys, "wipe", "--kv-dir", str(tier), "--older-than", "1h")
    assert code == 2 and "--yes" in err
    code, out, _ = run(capsys, "wipe", "--kv-dir", str(tier), "--older-than", "1h", "--yes", "--json")
    r = json.loads(out)
    assert code == 0 and (r["records_removed"], r["records_kept"], r["segments_deleted"]) == (8, 4, 2)
    assert r["segments_rewritten"] == 0 and r["bytes_freed"] == 8 * REC  # segments 1 and 2 are all > 1 h old
    got = read_back(tier)
    assert [i for i, v in got.items() if v is not None] == [8, 9, 10, 11]
    assert all(got[i] == payload(i) for i in (8, 9, 10, 11))


def test_wipe_rewrites_a_mixed_segment_keeping_created_at(tier, capsys):
    """--older-than 3h: segment 1 (all 50 h) goes, segment 2 (record 4 at 50 h, 5-7 at 2 h) is rewritten as
    segment 4 with 5-7 byte-identical (created_at kept, so their lifetime does not restart)."""
    code, out, _ = run(capsys, "wipe", "--kv-dir", str(tier), "--older-than", "3h", "--yes", "--json")
    r = json.loads(out)
    assert code == 0 and (r["records_removed"], r["records_kept"]) == (5, 7)
    assert (r["segments_deleted"], r["segments_rewritten"], r["bytes_freed"]) == (1, 1, 5 * REC)
    assert [p.name for p in segments(tier)] == ["000000000003.seg", "000000000004.seg"]
    got = read_back(tier)
    assert [i for i, v in got.items() if v is not None] == list(range(5, 12))
    assert all(got[i] == payload(i) for i in range(5, 12))
    with SSDStore(store_config(tier)) as store:
        for i in range(5, 12):
            age_h = (time.time() - store.entry(key(i)).created_at) / HOUR
            assert abs(age_h - AGES_H[i]) < 0.1, i
    code, out, _ = run(capsys, "verify", "--kv-dir", str(tier), "--json")
    assert code == 0 and json.loads(out)["records"] == 7


def test_wipe_all_removes_every_segment(tier, capsys):
    code, out, _ = run(capsys, "wipe", "--kv-dir", str(tier), "--all", "--yes")
    assert code == 0 and "removed 12 records" in out
    assert segments(tier) == [] and all(v is None for v in read_back(tier).values())


def test_every_command_refuses_a_directory_a_live_server_holds(tier, capsys):
    lock = KVDirLock.acquire(tier)  # what `flashtier serve` holds from start-up
    try:
        for argv in (["stats"], ["verify"], ["wipe", "--all", "--yes"], ["wipe", "--all", "--dry-run"]):
            code, out, err = run(capsys, *argv, "--kv-dir", str(tier))
            assert code == 2 and out == "", argv
            assert err == (f"flashtier: error: --kv-dir {tier} is held by a running flashtier server (pid "
                           f"{os.getpid()}); stop it first (flashtier kv never works on a live SSD tier)\n")
    finally:
        lock.release()
    assert len(segments(tier)) == 3
    with SSDStore(store_config(tier)):  # an open store (its LOCK) without a server lock
        code, _, err = run(capsys, "stats", "--kv-dir", str(tier))
        assert code == 2 and "held by a running flashtier server or SSD store" in err
        code, _, err = run(capsys, "wipe", "--all", "--yes", "--kv-dir", str(tier))
        assert code == 2 and "held by a running flashtier server or SSD store" in err
    assert len(segments(tier)) == 3


def test_a_server_cannot_start_while_a_wipe_holds_the_directory(tier):
    from flashtier.server.kv_admin.lock import admin_access

    with admin_access(tier, write=True):
        with pytest.raises(KVDirInUse, match=f"pid {os.getpid()}"):
            KVDirLock.acquire(tier)
    KVDirLock.acquire(tier).release()  # released with the wipe


def test_bad_directories_are_one_line_errors(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("FLASHTIER_KV_DIR", raising=False)
    monkeypatch.setenv("FLASHTIER_CACHE_DIR", str(tmp_path / "cache"))  # the default directory: surely absent
    code, _, err = run(capsys, "stats")
    assert code == 2 and "--kv-dir" in err and err.count("\n") == 1
    code, _, err = run(capsys, "verify", "--kv-dir", str(tmp_path / "missing"))
    assert code == 2 and "not a directory" in err and err.count("\n") == 1


def test_the_tools_default_to_the_directory_serve_uses(tmp_path, capsys):
    """Without --kv-dir, `kv stats` reads CACHE_DIR/kv/MODEL as `serve` does (the demo: CACHE_DIR/kv/demo-tiny);
    where that directory does not exist, one line naming --kv-dir."""
    from flashtier.server.cli import main
    from flashtier.server.config.settings import build_settings

    cache = tmp_path / "cache"
    served = build_settings(None, {"FLASHTIER_CACHE_DIR": str(cache)}).kvstore.ssd_dir
    assert main(["kv", "stats", "--cache-dir", str(cache)]) == 2
    assert "--kv-dir: no SSD tier at " + served in capsys.readouterr().err
    os.makedirs(served)
    assert main(["kv", "stats", "--cache-dir", str(cache), "--json"]) == 0
    capsys.readouterr()
