"""The restore path on CUDA (``-m gpu``): the kept buffer is pinned, ``install`` only issues the copy (it
returns while the stream is still busy with earlier work, so the copy is asynchronous), the pool rows
then hold the images bit for bit, and the next owner of the buffer waits for that copy. Also: a scatter
in several staging pieces, and a lookup of a TierManager asked for pinned memory reads into pinned slots."""

import time

import pytest
import torch

from flashtier.engine.tiers import restored_run
from flashtier.engine.tiers.restore_buffer import RestoreBuffer
from flashtier.engine.tiers.restored_run import RestoredRun
from flashtier.engine.tiers.manager import LookupQuery, TierManager
from flashtier.kvstore.block_hash import hash_blocks
from flashtier.kvstore.config import KVStoreConfig

from .scheduler_harness import NAMESPACE, prompt_of

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
SLOT = 56_960  # the real geometry's block image
N = 1_200  # 68 MB: one agent turn's worth of blocks
SLEEP_CYCLES = 500_000_000  # ~0.25-0.5 s of GPU time ahead of the copy on the same stream
IDS = {"range": list(range(7, 7 + N)), "scattered": [(j * 7919) % (2 * N) + 1 for j in range(N)]}


def filled(buf: RestoreBuffer) -> tuple[RestoredRun, torch.Tensor]:
    lease = buf.acquire(N)
    g = torch.Generator().manual_seed(5)
    want = torch.randint(0, 256, (N, SLOT), generator=g, dtype=torch.uint8)
    lease.rows.copy_(want)
    return RestoredRun(lease, N), want


@pytest.mark.parametrize("pattern", list(IDS))
def test_install_from_pinned_memory_is_asynchronous_and_exact(pattern):
    ids = IDS[pattern]
    assert len(set(ids)) == N
    buf = RestoreBuffer(SLOT, max_bytes=2 * N * SLOT, pinned=True, count=1)
    run, want = filled(buf)
    assert run.lease.pinned
    data = torch.zeros(2 * N + 8, SLOT, dtype=torch.uint8, device="cuda")
    stream = torch.cuda.current_stream()
    torch.empty(N, SLOT, dtype=torch.uint8, device="cuda")  # freed at once, kept cached: no cudaMalloc below
    torch.cuda.synchronize()
    torch.cuda._sleep(SLEEP_CYCLES)
    t0 = time.perf_counter()
    run.install(data, ids)
    issued = time.perf_counter() - t0
    busy = not stream.query()
    assert busy, "the stream finished the sleep before install returned: raise SLEEP_CYCLES"
    assert run.lease.released and buf.held == 0  # given back at once, with the copy's event
    t1 = time.perf_counter()
    nxt = buf.acquire(N)  # must wait for the copy out of the buffer
    waited = time.perf_counter() - t1
    assert buf.stats.waited_copies == 1 and stream.query()
    print(f"\n{pattern}: install issued in {issued * 1e3:.2f} ms; next acquire waited {waited * 1e3:.1f} ms")
    assert issued < waited  # install returned long before the sleep and the copy ended
    torch.cuda.synchronize()
    assert torch.equal(data[ids].cpu(), want)
    others = sorted(set(range(data.shape[0])) - set(ids))
    assert int(data[others].count_nonzero()) == 0
    nxt.release()


def test_a_scatter_in_several_staging_pieces_is_exact(monkeypatch):
    monkeypatch.setattr(restored_run, "STAGE_BYTES", 7 * SLOT)  # pieces of 7 blocks
    ids = IDS["scattered"][:50]
    buf = RestoreBuffer(SLOT, max_bytes=N * SLOT, pinned=True, count=1)
    run, want = filled(buf)
    data = torch.zeros(2 * N + 8, SLOT, dtype=torch.uint8, device="cuda")
    run.prefix(50).install(data, ids)
    torch.cuda.synchronize()
    assert torch.equal(data[ids].cpu(), want[:50])
    assert int(data.count_nonzero()) == int(want[:50].count_nonzero())


def test_a_lookup_for_a_cuda_pool_reads_into_pinned_slots(tmp_path):
    bs, slot = 8, 4_096
    tiers = TierManager(KVStoreConfig(block_size=bs, num_blocks=16, ssd_dir=str(tmp_path)))
    try:
        prompt = prompt_of(3 * bs)
        hashes = hash_blocks(NAMESPACE, prompt, bs)
        for j, h in enumerate(hashes):
            tiers.write_block(h, bytes([j + 1]) * slot)
        assert tiers.writer.flush(timeout=10)
        q = LookupQuery(NAMESPACE, prompt, hashes, 0, bs, block_bytes=slot, pin_memory=True)
        run = tiers.lookup(q).result(timeout=30).ssd_images
        assert tiers.restore.pinned and run.lease.pinned and len(run) == 3
        data = torch.zeros(4, slot, dtype=torch.uint8, device="cuda")
        run.install(data, [3, 1, 2])
        torch.cuda.synchronize()
        assert data[:, 0].tolist() == [0, 2, 3, 1]
    finally:
        tiers.close()
