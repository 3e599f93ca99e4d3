"""Undo what the rejected positions of a VERIFY chunk wrote into a sequence's KV state.

A VERIFY chunk feeds positions [n0, n0 + rows) through the encoder and the decoder. Every piece of state
those positions touch, and how it is put back to "positions [n0, keep) fed" (keep >= n0):

    tokens              truncated to ``keep``
    window rings        the slots (p % W, every layer) of rejected positions p get back the records and
                        positions saved before the step (they held p - W, which the window still needs)
    replay tail         rebuilt: the tail before the step + the chunk's encoder outputs of kept positions
    global entries      counts set to count_at(keep) (entries past it are stale bytes nobody reads; they are
                        rewritten when their positions are fed again, before their block can fill up)
    ratio-2 groups      before the step's when keep == n0, else none: ``keep_point`` only ever keeps an
                        even number of tokens past n0 (odd would need the open group of position keep - 1,
                        which the forward never returns for a row inside the chunk); a kept-back accepted
                        token is fed again with the next chunk
    blocks              the table is cut to the blocks of ``keep`` tokens (the rest go back to the pool);
                        the caller rolls back before hashing full blocks, so no block holding a rejected
                        token is ever registered in the prefix cache

The checkpoint is taken by the runner right before the forward (``take_checkpoint``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flashtier.engine.kv.manager import KVManager
from flashtier.engine.model.compressor import PartialGroup
from flashtier.engine.kv.paged_kv import PagedSequence


@dataclass(frozen=True)
class SpecCheckpoint:
    """What a VERIFY chunk of ``rows`` positions from ``n0`` overwrites, saved before the forward."""

    n0: int
    rows: int
    ring_data: torch.Tensor  # [L, rows, rec] the records in the chunk's slots before the step
    ring_pos: torch.Tensor  # [L, rows]
    tail_x: torch.Tensor | None
    tail_pre: torch.Tensor | None
    partial: dict[int, PartialGroup | None]


def take_checkpoint(kv: PagedSequence, rows: int) -> SpecCheckpoint:
    """Save what feeding ``rows`` more positions will overwrite. Mutates nothing."""
    n0 = len(kv.tokens)
    if rows > kv.window:
        raise ValueError(f"a VERIFY chunk of {rows} rows exceeds the window ({kv.window})")
    slots = torch.arange(n0, n0 + rows, device=kv.rings.pos.device) % kv.window
    # the tails are replaced, never written in place (push_tail), so keeping the references is enough
    return SpecCheckpoint(n0, rows, kv.rings.data[:, slots], kv.rings.pos[:, slots],  # gathers: copies
                          kv.tail_x, kv.tail_pre, dict(kv.partial))


def keep_point(n0: int, rows: int, accepted_end: int, align: int) -> int:
    """How many tokens the state keeps when positions [n0, accepted_end) are right: all of them when nothing
    was rejected, else the largest count >= n0 that is a multiple of ``align`` (2 with ratio-2 sources)."""
    if not n0 <= accepted_end <= n0 + rows:
        raise ValueError(f"accepted_end {accepted_end} outside the chunk [{n0}, {n0 + rows}]")
    if accepted_end == n0 + rows:
        return accepted_end
    return max(n0, accepted_end - accepted_end % align)


def rollback(kvm: KVManager, kv: PagedSequence, cp: SpecCheckpoint, keep: int) -> None:
    """Put ``kv`` back to "positions [0, keep) fed" after a chunk that fed [cp.n0, cp.n0 + cp.rows).

    ``keep`` must come from ``keep_point``. Mutates the tokens, rings, tail, partial groups, entry counts,
    the block table and the pool (blocks past ``keep`` released). Raises ValueError on a bad ``keep``.
    """
    end = cp.n0 + cp.rows
    if len(kv.tokens) != end:
        raise ValueError(f"the state holds {len(kv.tokens)} tokens, the checkpoint expects {end}")
    if keep == end:
        return
    if not cp.n0 <= keep < end:
        raise ValueError(f"keep {keep} outside [{cp.n0}, {end})")
    w = kv.window
    rejected = torch.arange(keep - cp.n0, cp.rows, device=kv.rings.pos.device)
    slots = (rejected + cp.n0) % w
    kv.rings.data[:, slots] = cp.ring_data[:, rejected]
    kv.rings.pos[:, slots] = cp.ring_pos[:, rejected]
    fed_x, fed_pre = kv.tail_x[-cp.rows :], kv.tail_pre[-cp.rows :]
    n_kept = keep - cp.n0
    if cp.tail_x is None:
        kv.tail_x, kv.tail_pre = fed_x[:n_kept].clone(), fed_pre[:n_kept].clone()
    else:
        kv.tail_x = torch.cat((cp.tail_x, fed_x[:n_kept]))[-w:]
        kv.tail_pre = torch.cat((cp.tail_pre, fed_pre[:n_kept]))[-w:]
    if keep == cp.n0:
        kv.partial = dict(cp.partial)
    else:
        for src, store in kv.stores.items():
            if src in kv.partial and keep % store.ratio:
                raise ValueError(f"keep {keep} would leave the ratio-{store.ratio} group of source {src} open")
        kv.partial = {src: None for src in kv.partial}
    del kv.tokens[keep:]
    for store in kv.stores.values():
        store.count = store.count_at(keep)
    need = -(-keep // kvm.block_size)
    if len(kv.table) > need:
        kvm.release(kv.table.ids[need:])
        kv.table.replace(kv.table.ids[:need])
