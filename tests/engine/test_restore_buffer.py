"""RestoreBuffer and RestoreLease on the CPU: growth (never shrinking, bounded), reuse, the hand-over rule
(a held buffer is never handed out again; the next owner waits for the copy out of it), one-off buffers,
collection of an unreleased lease, and argument checks. Slots of 8 bytes."""

import gc
import threading

import pytest
import torch

from flashtier.engine.tiers.restore_buffer import RestoreBuffer, RestoreLease

SLOT = 8


def fill(lease: RestoreLease, value: int) -> None:
    lease.writable()[:] = value


class FakeCopy:
    """Stands in for a CUDA event: records when the next owner synchronised on it."""

    def __init__(self, log: list[str]):
        self.log = log

    def synchronize(self) -> None:
        self.log.append("synchronized")


def test_a_buffer_grows_for_a_bigger_restore_and_never_shrinks():
    buf = RestoreBuffer(SLOT, max_bytes=100 * SLOT, count=1)
    assert buf.capacities == [0]
    a = buf.acquire(3)
    assert a.rows.shape == (3, SLOT) and buf.capacities == [3] and a.kept
    ptr = a.rows.data_ptr()
    a.release()
    b = buf.acquire(2)  # smaller: the same memory, no growth
    assert b.rows.data_ptr() == ptr and buf.capacities == [3]
    b.release()
    c = buf.acquire(5)  # bigger: at least doubled
    assert buf.capacities == [6] and c.rows.shape == (5, SLOT)
    c.release()
    buf.acquire(1).release()
    assert buf.capacities == [6]  # the largest restore seen stays
    assert (buf.stats.acquired, buf.stats.reused, buf.stats.grown, buf.stats.one_off) == (4, 2, 2, 0)


def test_growth_is_bounded_and_a_larger_restore_gets_a_one_off_buffer():
    buf = RestoreBuffer(SLOT, max_bytes=10 * SLOT + 7, count=1)  # room for 10 slots
    assert buf.max_slots == 10
    buf.acquire(6).release()
    lease = buf.acquire(8)
    assert buf.capacities == [10]  # doubling stops at the maximum
    lease.release()
    big = buf.acquire(11)
    assert not big.kept and big.rows.shape == (11, SLOT) and buf.capacities == [10]
    assert buf.held == 0 and buf.stats.one_off == 1
    big.release()


def test_a_held_buffer_is_never_handed_out_again():
    """The engine has not consumed lookup 1's run: lookups 2 and 3 fill other memory, run 1 stays intact."""
    buf = RestoreBuffer(SLOT, max_bytes=1 << 20, count=2)
    first = buf.acquire(4)
    fill(first, 0x11)
    second = buf.acquire(4)  # the other kept buffer
    third = buf.acquire(4)  # both held: a one-off
    assert second.kept and not third.kept and buf.held == 2
    fill(second, 0x22)
    fill(third, 0x33)
    assert len({lease.rows.data_ptr() for lease in (first, second, third)}) == 3
    assert torch.equal(first.rows, torch.full((4, SLOT), 0x11, dtype=torch.uint8))
    ptr = first.rows.data_ptr()
    first.release()
    again = buf.acquire(2)  # the only free kept buffer: run 1's, now given back
    assert again.kept and again.rows.data_ptr() == ptr
    for lease in (second, third, again):
        lease.release()


def test_the_next_owner_waits_for_the_copy_out_of_the_buffer():
    log: list[str] = []
    buf = RestoreBuffer(SLOT, max_bytes=1 << 20, count=1)
    lease = buf.acquire(2)
    lease.release(FakeCopy(log))
    assert log == []  # release itself never waits
    nxt = buf.acquire(2)
    assert log == ["synchronized"] and buf.stats.waited_copies == 1
    nxt.release()
    buf.acquire(2).release()
    assert log == ["synchronized"]  # released without a copy: nothing to wait for


def test_a_failed_wait_gives_the_buffer_back():
    class Broken:
        def synchronize(self):
            raise RuntimeError("device lost")

    buf = RestoreBuffer(SLOT, max_bytes=1 << 20, count=1)
    buf.acquire(2).release(Broken())
    with pytest.raises(RuntimeError, match="device lost"):
        buf.acquire(2)
    assert buf.held == 0
    buf.acquire(2).release()


def test_a_dropped_lease_gives_its_buffer_back_when_collected():
    buf = RestoreBuffer(SLOT, max_bytes=1 << 20, count=1)
    lease = buf.acquire(3)
    assert buf.held == 1
    del lease
    gc.collect()
    assert buf.held == 0 and buf.acquire(3).kept


def test_release_is_idempotent_and_a_released_lease_cannot_be_read():
    buf = RestoreBuffer(SLOT, max_bytes=1 << 20, count=1)
    lease = buf.acquire(1)
    lease.release()
    lease.release()
    assert buf.held == 0 and lease.released
    with pytest.raises(RuntimeError, match="after release"):
        lease.rows
    with pytest.raises(RuntimeError, match="after release"):
        lease.writable()


def test_concurrent_acquires_never_share_a_buffer():
    buf = RestoreBuffer(SLOT, max_bytes=1 << 20, count=2)
    leases: list[RestoreLease] = []
    lock = threading.Lock()

    def take():
        lease = buf.acquire(4)
        with lock:
            leases.append(lease)

    threads = [threading.Thread(target=take) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len({lease.rows.data_ptr() for lease in leases}) == 6
    assert sum(lease.kept for lease in leases) == 2 and buf.stats.one_off == 4


@pytest.mark.parametrize("kwargs,name", [({"slot_bytes": 0}, "slot_bytes"), ({"max_bytes": -1}, "max_bytes"),
                                         ({"count": 0}, "count"), ({"slot_bytes": True}, "slot_bytes")])
def test_bad_arguments_are_named(kwargs, name):
    args = {"slot_bytes": SLOT, "max_bytes": 64, "count": 2, **kwargs}
    with pytest.raises(ValueError, match=name):
        RestoreBuffer(args.pop("slot_bytes"), **args)
    with pytest.raises(ValueError, match="^n must"):
        RestoreBuffer(SLOT).acquire(0)


def test_pinned_memory_needs_cuda():
    if torch.cuda.is_available():
        pytest.skip("CUDA is here: pinned buffers are allowed (see test_restore_buffer_gpu.py)")
    with pytest.raises(ValueError, match="pinned"):
        RestoreBuffer(SLOT, pinned=True)
