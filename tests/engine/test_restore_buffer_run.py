"""RestoredRun.install against the oracle (``load_block`` of each image as bytes, the old install): the
pool's bytes must be identical, untouched rows included, on named grids of run lengths and block-id
patterns (a contiguous range, scattered ids, ragged lengths with runs of consecutive ids; the device
paths are in test_restore_buffer_gpu.py). Also: prefixes,
the lease given back, argument checks, and that the comparison catches a one-byte difference."""

import pytest
import torch

from flashtier.engine.tiers.restore_buffer import RestoreBuffer
from flashtier.engine.tiers.restored_run import RestoredRun
from flashtier.engine.tiers.resume import load_run
from flashtier.kvstore.block_hash import hash_blocks

from .restore_bytes_oracle import load_run_from_bytes
from .scheduler_harness import NAMESPACE, Harness, prompt_of

IDS = {  # name -> block ids of the fresh blocks (pool of 32, block 0 the null block)
    "one": [5],
    "range": [3, 4, 5, 6, 7],
    "scattered": [9, 2, 30, 17, 4, 11, 25],
    "reversed": [12, 11, 10],
    "ragged-13": [31, 6, 7, 8, 9, 22, 23, 1, 15, 16, 14, 28, 3],
}


def images(n: int, size: int, seed: int) -> list[bytes]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (size,), generator=g, dtype=torch.uint8).numpy().tobytes() for _ in range(n)]


def filled_pool(seed: int = 7) -> Harness:
    """A pool of random bytes whose usable blocks (1..31) are all held, as fresh blocks are."""
    h = Harness(num_blocks=32)
    assert h.kvm.allocate(31) is not None
    g = torch.Generator().manual_seed(seed)
    h.kvm.kv.data.copy_(torch.randint(0, 256, h.kvm.kv.data.shape, generator=g, dtype=torch.uint8))
    return h


def buffered_run(imgs: list[bytes]) -> RestoredRun:
    """The images in a lease of a kept restore buffer, as a lookup leaves them."""
    buf = RestoreBuffer(len(imgs[0]), max_bytes=1 << 20)
    lease = buf.acquire(len(imgs))
    lease.writable()[:] = torch.frombuffer(bytearray(b"".join(imgs)), dtype=torch.uint8).numpy()
    return RestoredRun(lease, len(imgs))


def both_paths(ids: list[int], imgs: list[bytes]) -> tuple[Harness, Harness]:
    """The same pool loaded by the buffer path and by the oracle."""
    hashes = hash_blocks(NAMESPACE, prompt_of(4 * len(ids)), 4)
    new, old = filled_pool(), filled_pool()
    load_run(new.kvm, buffered_run(imgs), ids, hashes)
    load_run_from_bytes(old.kvm, RestoredRun.from_images(imgs), ids, hashes)
    return new, old


@pytest.mark.parametrize("name", list(IDS))
def test_install_matches_the_per_block_bytes_path(name):
    ids = IDS[name]
    new, old = both_paths(ids, images(len(ids), Harness().kvm.layout.block_bytes, seed=len(ids)))
    assert torch.equal(new.kvm.kv.data, old.kvm.kv.data)
    assert [new.kvm.pool.blocks[i].block_hash for i in ids] == [old.kvm.pool.blocks[i].block_hash for i in ids]
    assert all(new.kvm.pool.blocks[i].block_hash is not None for i in ids)


def test_the_comparison_catches_one_differing_byte():
    ids = IDS["scattered"]
    imgs = images(len(ids), Harness().kvm.layout.block_bytes, seed=5)
    new, _ = both_paths(ids, imgs)
    broken = list(imgs)
    broken[4] = broken[4][:10] + bytes([broken[4][10] ^ 1]) + broken[4][11:]
    _, old = both_paths(ids, broken)
    assert not torch.equal(new.kvm.kv.data, old.kvm.kv.data)


def test_a_prefix_installs_its_images_only_and_install_gives_the_lease_back():
    size = Harness().kvm.layout.block_bytes
    imgs = images(5, size, seed=9)
    run = buffered_run(imgs)
    lease = run.lease
    head = run.prefix(3)
    assert (len(head), len(run.prefix(9)), len(run.prefix(-2))) == (3, 5, 0)
    assert [head.image(j) for j in range(3)] == imgs[:3]
    h = filled_pool()
    before = h.kvm.kv.data.clone()
    head.install(h.kvm.kv.data, [20, 21, 2])
    assert [h.kvm.image(i) for i in (20, 21, 2)] == imgs[:3]
    rest = [i for i in range(32) if i not in (20, 21, 2)]
    assert torch.equal(h.kvm.kv.data[rest], before[rest])
    assert lease.released
    with pytest.raises(RuntimeError, match="after release"):
        run.image(0)


def test_bad_installs_raise_and_keep_the_lease():
    h = filled_pool()
    size = h.kvm.layout.block_bytes
    run = buffered_run(images(2, size, seed=1))
    with pytest.raises(ValueError, match="block_ids"):
        run.install(h.kvm.kv.data, [1])
    with pytest.raises(ValueError, match="block_ids"):
        run.install(h.kvm.kv.data, [1, 32])
    with pytest.raises(ValueError, match="data"):
        run.install(h.kvm.kv.data[:, 1:], [1, 2])
    assert not run.lease.released
    short = buffered_run(images(2, size - 1, seed=1))
    with pytest.raises(ValueError, match="block image has"):
        load_run(h.kvm, short, [1, 2], hash_blocks(NAMESPACE, prompt_of(8), 4))
    run.install(h.kvm.kv.data, [1, 2])
    assert run.lease.released


def test_from_images_and_empty_runs():
    assert len(RestoredRun.from_images(())) == 0 and RestoredRun.empty().slot_bytes == 0
    RestoredRun.empty().install(torch.zeros(2, 4, dtype=torch.uint8), [])  # nothing to do
    with pytest.raises(ValueError, match="one length"):
        RestoredRun.from_images((b"ab", b"abc"))
    with pytest.raises(ValueError, match="count"):
        RestoredRun(None, 1)
