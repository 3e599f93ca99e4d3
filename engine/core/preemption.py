"""Preemption by swap: a sequence's private state and block images go to the host, its blocks are freed,
and swap-in restores both exactly (recomputation would re-run the prompt; a swap costs one copy).

    swap_out: PagedSequence ──private_state() + image(b) for b in table──▶ SwappedState (host)
              blocks released (full ones stay cached, LRU)
    swap_in:  fresh blocks ◀── images; private state restored; full blocks re-registered by hash
"""

from __future__ import annotations

from dataclasses import dataclass

from flashtier.engine.kv.manager import KVManager
from flashtier.engine.kv.paged_kv import PrivateState
from flashtier.engine.core.request import Sequence


@dataclass(frozen=True)
class SwappedState:
    """A preempted sequence: its private state and the images of its blocks, in table order."""

    private: PrivateState
    images: tuple[bytes, ...]


def swap_out(kvm: KVManager, seq: Sequence) -> None:
    """Copy ``seq``'s state to the host and free its blocks.

    Mutates: ``seq.swapped`` (set), the pool, ``seq.kv.table`` (emptied).
    """
    seq.swapped = SwappedState(seq.kv.private_state(), tuple(kvm.image(b) for b in seq.kv.table.ids))
    kvm.free(seq.kv)


def blocks_to_swap_in(seqs: list[Sequence]) -> int:
    return sum(len(s.swapped.images) for s in seqs if s.swapped is not None)


def swap_in(kvm: KVManager, seq: Sequence) -> None:
    """Restore a swapped sequence into fresh blocks (the caller checked ``blocks_to_swap_in``).

    Mutates: the pool, ``seq.kv`` (table, private state), ``seq.swapped`` (cleared).
    """
    st = seq.swapped
    assert st is not None, "swap_in of a sequence that was not swapped out"
    blocks = kvm.allocate(len(st.images))
    assert blocks is not None, "swap_in without room: check blocks_to_swap_in first"
    for b, img in zip(blocks, st.images):
        kvm.load_image(b.block_id, img)
    seq.kv.table.replace([b.block_id for b in blocks])
    seq.kv.restore_private_state(st.private)
    for b, h in zip(blocks, seq.hashes):
        kvm.pool.cache_full_block(b, h, seq.tenant)
    seq.swapped = None
