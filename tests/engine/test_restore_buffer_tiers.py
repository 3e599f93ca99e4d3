"""TierManager lookups through the restore buffer, against the bytes path (``get_many``, the run ending at
the first None) on a copy of the same SSD directory: identical images, a damaged block truncating the
run at the same point (a snapshot above it turns into a MISS), a buffer growing for a bigger restore,
a result the engine has not consumed surviving later lookups, and failures that give the buffer back.
Real SSD store and embedded snapshot pool; no model. Block size 8 (tiny geometry)."""

import gc
import os
import shutil
import subprocess
import sys
import threading

import pytest
import torch

from flashtier.engine.tiers.snapshot_codec import encode_snapshot
from flashtier.engine.tiers.manager import LookupQuery, SnapshotOutcome, TierLookup, TierManager
from flashtier.kvstore.block_hash import hash_blocks
from flashtier.kvstore.config import KVStoreConfig
from flashtier.kvstore.snapshot.key import SnapshotKey
from flashtier.kvstore.ssd.record import HEADER_BYTES

from ..kvstore.ssd_store_support import flip
from .restore_bytes_oracle import bytes_prefix
from .scheduler_harness import NAMESPACE, Harness, prompt_of

BS = 8
PROMPT = prompt_of(10 * BS)
HASHES = hash_blocks(NAMESPACE, PROMPT, BS)
SPEC_H = Harness(block_size=BS)
BLOCK_BYTES = SPEC_H.kvm.layout.block_bytes


def image(j: int) -> bytes:
    g = torch.Generator().manual_seed(100 + j)
    return torch.randint(0, 256, (BLOCK_BYTES,), generator=g, dtype=torch.uint8).numpy().tobytes()


def config(path) -> KVStoreConfig:
    return KVStoreConfig(block_size=BS, num_blocks=64, ssd_dir=str(path))


def written(tmp_path, blocks: int = 9) -> TierManager:
    """A TierManager whose SSD holds the first ``blocks`` blocks of PROMPT."""
    tiers = TierManager(config(tmp_path / "a"))
    for j in range(blocks):
        tiers.write_block(HASHES[j], image(j))
    assert tiers.writer.flush(timeout=10)
    return tiers


def twin(tiers: TierManager, tmp_path) -> TierManager:
    """Another TierManager over a copy of ``tiers``' SSD directory (the oracle reads there)."""
    tiers.writer.flush(timeout=10)
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    return TierManager(config(tmp_path / "b"))


def lookup(tiers: TierManager, hbm_blocks: int = 0, prompt=PROMPT) -> TierLookup:
    q = LookupQuery(NAMESPACE, prompt, HASHES[: len(prompt) // BS], hbm_blocks, BS, block_bytes=BLOCK_BYTES)
    return tiers.lookup(q).result(timeout=30)


def images_of(found: TierLookup) -> tuple[bytes, ...]:
    run = found.ssd_images
    return tuple(run.image(j) for j in range(len(run)))


def put_snapshot(tiers: TierManager, point: int) -> None:
    kv = SPEC_H.kvm.new_kv()
    kv.tokens, kv.enc_start, kv.write_from = PROMPT[:point], 0, point
    kv.rings.pos[:] = torch.arange(point - kv.window, point)
    payload = encode_snapshot(kv, SPEC_H.spec.n_encoder_layers, bytes(BLOCK_BYTES), SPEC_H.spec.partial_order)
    b = point // BS
    tiers.put_snapshot(SnapshotKey.for_tail(NAMESPACE, HASHES[b - 1], PROMPT[b * BS : point]), payload)
    for fut in list(tiers._pending):
        fut.result(timeout=10)


@pytest.fixture
def closing():
    opened: list[TierManager] = []
    yield opened.append
    for tiers in opened:
        tiers.close()


@pytest.mark.parametrize("hbm_blocks", [0, 1, 4])
def test_a_restore_through_the_buffer_equals_the_bytes_path(tmp_path, closing, hbm_blocks):
    tiers = written(tmp_path)
    closing(tiers)
    found = lookup(tiers, hbm_blocks)
    want = bytes_prefix(tiers.ssd, HASHES[hbm_blocks:9])
    assert len(want) == 9 - hbm_blocks and images_of(found) == want
    assert found.ssd_images.lease.kept and tiers.restore.held == 1
    assert found.outcome is SnapshotOutcome.NONE and found.snapshot_point is None


@pytest.mark.parametrize("damaged,at", [(0, 3), (3, 3), (8, 3), (3, HEADER_BYTES + 17)],
                         ids=["first-header", "middle-header", "last-header", "middle-payload"])
def test_a_damaged_block_truncates_the_run_where_the_bytes_path_does(tmp_path, closing, damaged, at):
    tiers = written(tmp_path)
    oracle = twin(tiers, tmp_path)
    closing(tiers), closing(oracle)
    for t in (tiers, oracle):
        flip(t.ssd, HASHES[damaged], at)
    want = bytes_prefix(oracle.ssd, HASHES[:9])
    found = lookup(tiers)
    assert len(want) == damaged and images_of(found) == want
    assert tiers.ssd.stats().corrupt_records == 1 and HASHES[damaged] not in tiers.ssd


def test_a_snapshot_above_a_damaged_block_is_a_miss(tmp_path, closing):
    tiers = written(tmp_path)
    closing(tiers)
    put_snapshot(tiers, 5 * BS + 3)  # P: blocks 0..4 below it
    found = lookup(tiers)
    assert (found.snapshot_point, found.outcome, len(found.ssd_images)) == (5 * BS + 3, SnapshotOutcome.HIT, 5)
    found.ssd_images.release()
    flip(tiers.ssd, HASHES[2], HEADER_BYTES + 1)
    found = lookup(tiers)  # the index still lists block 2: P is chosen, then the read of block 2 fails
    assert (found.snapshot_point, found.snapshot_payload, found.outcome) == (None, None, SnapshotOutcome.MISS)
    assert len(found.ssd_images) == 2


def test_the_buffer_grows_for_a_bigger_restore(tmp_path, closing):
    tiers = written(tmp_path)
    closing(tiers)
    small = lookup(tiers, prompt=PROMPT[: 3 * BS + 1])  # 3 blocks
    assert len(small.ssd_images) == 3 and tiers.restore.capacities == [3, 0]
    small.ssd_images.release()
    big = lookup(tiers)  # 9 blocks
    assert len(big.ssd_images) == 9 and tiers.restore.capacities == [9, 0]
    assert images_of(big) == tuple(image(j) for j in range(9))
    big.ssd_images.release()
    lookup(tiers, prompt=PROMPT[: 2 * BS]).ssd_images.release()
    assert tiers.restore.capacities == [9, 0] and tiers.restore.stats.grown == 2


def test_a_lookup_never_overwrites_a_result_the_engine_has_not_consumed(tmp_path, closing):
    tiers = written(tmp_path)
    closing(tiers)
    first = lookup(tiers, prompt=PROMPT[: 5 * BS + 1])  # not installed yet: its request is LOADING
    second = lookup(tiers, hbm_blocks=2)  # blocks 2..8: other bytes in the slots the first one uses
    third = lookup(tiers, hbm_blocks=4)
    assert images_of(first) == tuple(image(j) for j in range(5))
    assert images_of(second) == tuple(image(j) for j in range(2, 9))
    assert images_of(third) == tuple(image(j) for j in range(4, 9))
    leases = [f.ssd_images.lease for f in (first, second, third)]
    assert [lease.kept for lease in leases] == [True, True, False]
    assert len({lease.rows.data_ptr() for lease in leases}) == 3
    ptr = leases[0].rows.data_ptr()
    first.ssd_images.release()  # installed: its buffer is free again
    fourth = lookup(tiers, prompt=PROMPT[: BS + 1])
    assert fourth.ssd_images.lease.kept and fourth.ssd_images.lease.rows.data_ptr() == ptr


@pytest.fixture
def busy_cpu():
    """Every core kept busy by a spinning process (the machine is loaded, as under `make test`), and the
    garbage collector off: a lease left to the collector is never returned here."""
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(os.cpu_count() or 2)]
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
        for hog in hogs:
            hog.kill()
            hog.wait()


def test_a_dropped_lookup_gives_its_buffer_back(tmp_path, closing, busy_cpu):
    """The request was aborted while LOADING after its lookup finished: the drop releases at once."""
    tiers = written(tmp_path)
    closing(tiers)
    fut = tiers.lookup(LookupQuery(NAMESPACE, PROMPT, HASHES, 0, BS, block_bytes=BLOCK_BYTES))
    assert len(fut.result(timeout=60).ssd_images) == 9 and tiers.restore.held == 1
    tiers.drop_lookup(fut)
    assert tiers.restore.held == 0
    assert tiers.restore.stats.one_off == 0 and lookup(tiers).ssd_images.lease.kept  # the kept buffer again


def test_a_lookup_dropped_in_flight_gives_its_buffer_back_as_it_completes(tmp_path, closing, busy_cpu, monkeypatch):
    """Dropped while the SSD read is still running: the read completes, then its lease is released on the
    I/O thread; ``barrier`` waits for that release, never for a timer or the collector."""
    tiers = written(tmp_path)
    closing(tiers)
    reading, go_on = threading.Event(), threading.Event()
    read = tiers.ssd.get_many_into

    def slow(keys, dest, slot_bytes):
        reading.set()
        assert go_on.wait(timeout=60)
        return read(keys, dest, slot_bytes)

    monkeypatch.setattr(tiers.ssd, "get_many_into", slow)
    fut = tiers.lookup(LookupQuery(NAMESPACE, PROMPT, HASHES, 0, BS, block_bytes=BLOCK_BYTES))
    assert reading.wait(timeout=60) and not fut.done() and tiers.restore.held == 1
    tiers.drop_lookup(fut)
    go_on.set()
    assert len(fut.result(timeout=60).ssd_images) == 9
    tiers.barrier(timeout=60)
    assert tiers.restore.held == 0


def test_without_the_drop_the_buffer_stays_held(tmp_path, closing, busy_cpu):
    """The check can fail: a lookup nobody installs or drops keeps its kept buffer (the collector is off)."""
    tiers = written(tmp_path)
    closing(tiers)
    fut = tiers.lookup(LookupQuery(NAMESPACE, PROMPT, HASHES, 0, BS, block_bytes=BLOCK_BYTES))
    fut.result(timeout=60)
    tiers.barrier(timeout=60)
    assert tiers.restore.held == 1
    tiers.drop_lookup(fut)
    assert tiers.restore.held == 0


def test_a_failing_read_is_a_miss_and_gives_the_buffer_back(tmp_path, closing, monkeypatch):
    tiers = written(tmp_path)
    closing(tiers)

    def broken(keys, dest, slot_bytes):
        raise RuntimeError("the SSD store is closed")

    monkeypatch.setattr(tiers.ssd, "get_many_into", broken)
    found = lookup(tiers)
    assert (len(found.ssd_images), found.outcome) == (0, SnapshotOutcome.ERROR) and tiers.restore.held == 0


def test_a_query_without_block_bytes_is_refused(tmp_path, closing):
    tiers = written(tmp_path, blocks=1)
    closing(tiers)
    with pytest.raises(ValueError, match="block_bytes"):
        tiers.lookup(LookupQuery(NAMESPACE, PROMPT, HASHES, 0, BS))
    lookup(tiers).ssd_images.release()
    with pytest.raises(ValueError, match="block_bytes"):
        tiers.lookup(LookupQuery(NAMESPACE, PROMPT, HASHES, 0, BS, block_bytes=BLOCK_BYTES + 1))
