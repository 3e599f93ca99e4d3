"""What the SSD tier tests share: 100 B records (60 B header + 40 B payload), key-derived payloads, a fake
clock, the store factory fixture and byte flips behind the store's back."""

import os

import pytest
import xxhash

from flashtier.kvstore.block_hash import BlockHash
from flashtier.kvstore.config import KVStoreConfig
from flashtier.kvstore.ssd.record import HEADER_BYTES
from flashtier.kvstore.ssd.store import SSDStore


HOUR = 3600.0
LIFETIME = 72 * HOUR
P = 100 - HEADER_BYTES  # payload bytes (40)
REC = HEADER_BYTES + P  # 100 B per record
T0 = 1_000_000.0


class FakeClock:
    def __init__(self, t: float = T0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, seconds: float) -> None:
        self.t += seconds


def key(i: int) -> BlockHash:
    return BlockHash(xxhash.xxh3_128_digest(i.to_bytes(8, "little")))


def payload(k: BlockHash, n: int = P) -> bytes:
    """Key-derived bytes: any payload served for ``k`` can be checked against this."""
    return (xxhash.xxh3_128_digest(k.digest + b"payload") * (n // 16 + 1))[:n]


def config(tmp_path, *, budget=12 * REC, segment=4 * REC) -> KVStoreConfig:
    return KVStoreConfig(ssd_dir=str(tmp_path / "ssd"), ssd_budget_bytes=budget, ssd_segment_bytes=segment)


@pytest.fixture
def clock():
    return FakeClock()


@pytest.fixture
def open_store(tmp_path, clock):
    stores = []

    def _open(**kw):
        cfg_kw = {k: kw.pop(k) for k in ("budget", "segment") if k in kw}
        store = SSDStore(config(tmp_path, **cfg_kw), clock=kw.pop("clock", clock), **kw)
        stores.append(store)
        return store

    yield _open
    for s in stores:
        s.close()


def put_all(store, keys):
    results = [store.put(k, payload(k)) for k in keys]
    assert store.flush()
    return results


def seg_files(store):
    return sorted(n for n in os.listdir(store.segment_path(0).parent) if n.endswith(".seg"))


def flip(store, k: BlockHash, at: int) -> None:
    """Flip one byte ``at`` bytes into ``k``'s record, behind the store's back."""
    e = store.entry(k)
    with open(store.segment_path(e.segment_id), "r+b") as f:
        f.seek(e.offset + at)
        b = f.read(1)
        f.seek(e.offset + at)
        f.write(bytes([b[0] ^ 0x5A]))


def ssd_payloads(kv_dir) -> dict[bytes, set[bytes]]:
    """tenant tag -> payloads of its SSD records in every file under ``kv_dir`` (records found by magic)."""
    from flashtier.kvstore.ssd.record import HEADER_BYTES, MAGIC, RecordCorrupt, decode_header

    out: dict[bytes, set[bytes]] = {}
    for path in kv_dir.rglob("*"):
        if not path.is_file():
            continue
        data = path.read_bytes()
        at = data.find(MAGIC)
        while at >= 0:
            try:
                h = decode_header(data[at : at + HEADER_BYTES])
            except RecordCorrupt:
                pass
            else:
                out.setdefault(h.tenant, set()).add(data[at + HEADER_BYTES : at + HEADER_BYTES + h.length])
            at = data.find(MAGIC, at + 1)
    return out
