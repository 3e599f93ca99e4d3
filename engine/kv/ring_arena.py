"""Every running sequence's window rings in one device tensor, so a step gathers all rows' windows at once.

    data [L, (slots+1) * W, rec] uint8 layer l's rings of every slot, back to back (rec = hd + hd/32: FP8 records)
    pos  [L, (slots+1) * W] int64      position held by each ring row (-1 = empty)

A sequence's ``WindowRings`` is a view of one slot (``data[:, slot*W : (slot+1)*W]``): the batched forward reads
layer l of every sequence with one gather from ``data[l]`` and writes its rows back with one index_copy, with no
per-sequence tensor ops. Slots return to the free list when the view that holds them is garbage collected
(``weakref.finalize``), so no caller has to release them; a sequence created while every slot is taken gets
private rings (``acquire`` returns None) and steps holding one run the per-sequence path. One more slot,
``pad_slot``, is never handed out: padded rows of a CUDA-graph batch (engine/runner/decode_graphs.py) write there.

Not thread-safe: the engine thread owns it.
"""

from __future__ import annotations

import weakref

import torch


class RingArena:
    def __init__(self, n_layers: int, window: int, head_dim: int, slots: int, device: torch.device | str):
        if slots < 1:
            raise ValueError(f"a ring arena needs at least one slot, got {slots}")
        self.n_layers, self.window, self.head_dim, self.slots = n_layers, window, head_dim, slots
        self.record_bytes = head_dim + head_dim // 32
        self.pad_slot = slots  # after the slots acquire() hands out
        self.data = torch.zeros(n_layers, (slots + 1) * window, self.record_bytes, dtype=torch.uint8, device=device)
        self.pos = torch.full((n_layers, (slots + 1) * window), -1, dtype=torch.long, device=device)
        self._free = list(range(slots - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def acquire(self) -> int | None:
        """A free slot with its rings emptied, or None when all are taken. Mutates the free list."""
        if not self._free:
            return None
        slot = self._free.pop()
        self.pos[:, self.rows(slot)] = -1
        return slot

    def rows(self, slot: int) -> slice:
        return slice(slot * self.window, (slot + 1) * self.window)

    def views(self, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(data [L, W, rec], pos [L, W]) of ``slot``: writes through them land in the arena."""
        r = self.rows(slot)
        return self.data[:, r], self.pos[:, r]

    def release_when_dead(self, owner: object, slot: int) -> None:
        """Return ``slot`` to the free list once ``owner`` is garbage collected."""
        weakref.finalize(owner, self._free.append, slot)
