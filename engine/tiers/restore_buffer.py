"""RestoreBuffer: the reused host memory SSD restores are read into, one per ``TierManager``.

A restore reads verified block images straight into slots of a host buffer (``SSDStore.get_many_into``)
and the engine copies the run to the device in one transfer (``RestoredRun.install``). Reusing the buffer
keeps the read free of page faults and, on CUDA, lets that transfer run from pinned memory::

    tier I/O thread (a worker of its loop)               engine thread
    lease = acquire(n)  -- waits for the last copy out of that buffer (its event), grows it if needed
    get_many_into(keys, lease.writable(), slot)
    TierLookup(RestoredRun(lease, ok prefix)) --future-->  install: one H2D copy (non_blocking when pinned),
                                                           scatter to the pool's block ids,
                                                           lease.release(event of that copy)

Ownership: a kept buffer has one owner at a time. Free -> the lookup that acquires it (it alone writes
it) -> the engine thread, once the lookup's future hands the result over (it only reads) -> free again
at ``release``. ``count`` buffers (default two) are kept so the engine can install one restore while the
next lookup fills another. ``acquire`` never waits for the engine: when every kept buffer is held (a
request still LOADING for want of pool blocks, or several lookups in flight) or a restore is larger than
``max_bytes``, it hands out a one-off buffer of plain memory, used once and dropped, so a lookup can
never overwrite a buffer the engine has not consumed. What it does wait for is the device: a copy out
of pinned memory may still be reading the buffer when ``release`` returns, so the next ``acquire`` of
that buffer synchronises on the event ``release`` was given. A lookup whose request is aborted while
LOADING is released by the abort (``TierManager.drop_lookup``: at once, or as the read completes); a
lease dropped unreleased by some other path still gives its buffer back when it is garbage-collected,
a last resort that no path relies on.

A kept buffer grows (to the restore's size, at least doubling) and never shrinks, up to ``max_bytes``.
Thread-safe: one small (reentrant) lock over the free list and the counters, never held across a wait
or an allocation.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

RESTORE_MAX_BYTES = 1 << 30  # per kept buffer: a 1M-token context of the real geometry (890 B/token) fits


class CopyDone(Protocol):
    """What ``release`` may be given: a ``torch.cuda.Event`` recorded after the last copy out of the buffer."""

    def synchronize(self) -> None: ...


@dataclass
class RestoreStats:
    """Monotonic counters of one ``RestoreBuffer`` (read without the lock: a stale value is fine)."""

    acquired: int = 0  # leases handed out
    reused: int = 0  # ... from a kept buffer already large enough
    grown: int = 0  # ... from a kept buffer reallocated larger first
    one_off: int = 0  # ... of a buffer of their own (every kept one held, or larger than max_bytes)
    waited_copies: int = 0  # acquisitions that synchronised on a copy still reading the buffer


class RestoreLease:
    """``n`` block slots of host memory, held by one owner until ``release``.

    ``rows`` is [n, slot_bytes] uint8. A lease of a kept buffer returns it to its ``RestoreBuffer`` on
    ``release`` (or when collected unreleased); a one-off lease just drops its memory.
    """

    def __init__(self, host: torch.Tensor, n: int, slot_bytes: int,
                 give_back: Callable[[CopyDone | None], None] | None = None) -> None:  # fmt: skip
        """``host``: a 1-D uint8 CPU tensor of at least ``n * slot_bytes`` bytes (only those are used);
        ``give_back(copy_done)``: called once, by ``release`` or by the finalizer (with None)."""
        if host.dtype != torch.uint8 or host.dim() != 1 or host.device.type != "cpu":
            raise ValueError(f"host must be a 1-D uint8 CPU tensor, got {host.dtype} {tuple(host.shape)} "
                             f"on {host.device}")  # fmt: skip
        if n < 0 or slot_bytes < 1 or host.numel() < n * slot_bytes:
            raise ValueError(f"host holds {host.numel()} B, {n} slots of {slot_bytes} B do not fit")
        self.n, self.slot_bytes = n, slot_bytes
        self.kept = give_back is not None
        self._rows: torch.Tensor | None = host[: n * slot_bytes].view(n, slot_bytes)
        self._give_back = give_back
        # the callback must not reference the lease, or it would never be collected
        self._finalizer = weakref.finalize(self, give_back, None) if give_back is not None else None

    @property
    def released(self) -> bool:
        return self._rows is None

    @property
    def rows(self) -> torch.Tensor:
        """The slots as [n, slot_bytes] uint8. RuntimeError once released (the buffer may be refilled)."""
        if self._rows is None:
            raise RuntimeError("restore lease used after release: its buffer may hold another restore")
        return self._rows

    @property
    def pinned(self) -> bool:
        return self.rows.is_pinned()

    def writable(self) -> np.ndarray:
        """The slots as one writable, C-contiguous byte array (what ``get_many_into`` fills)."""
        return self.rows.view(-1).numpy()

    def release(self, copy_done: CopyDone | None = None) -> None:
        """Give the buffer back; ``copy_done``: an event recorded after the last asynchronous copy out of
        it (the next owner synchronises on it before writing). Mutates the owning ``RestoreBuffer``'s
        free list. A second call does nothing."""
        if self._rows is None:
            return
        self._rows = None
        if self._finalizer is not None:
            self._finalizer.detach()
            assert self._give_back is not None
            self._give_back(copy_done)


@dataclass
class _Kept:
    """One kept buffer: its memory, capacity in slots, owner flag and the copy that may still read it."""

    flat: torch.Tensor | None = None
    capacity: int = 0
    held: bool = False
    copy_done: CopyDone | None = None


class RestoreBuffer:
    """``count`` reused host buffers of ``slot_bytes`` slots, grown on demand up to ``max_bytes`` each."""

    def __init__(self, slot_bytes: int, *, max_bytes: int = RESTORE_MAX_BYTES, pinned: bool = False,
                 count: int = 2) -> None:  # fmt: skip
        """``pinned``: page-locked memory (the pool is on CUDA: the copy to it then runs asynchronously).
        ValueError naming ``slot_bytes`` (< 1), ``max_bytes`` (< 0), ``count`` (< 1) or ``pinned``
        (without CUDA)."""
        for name, value, least in (("slot_bytes", slot_bytes, 1), ("max_bytes", max_bytes, 0), ("count", count, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"{name} must be an int >= {least}, got {value!r}")
        if pinned and not torch.cuda.is_available():
            raise ValueError("pinned=True needs CUDA (page-locked memory is a CUDA allocation)")
        self.slot_bytes, self.pinned = slot_bytes, pinned
        self.max_slots = max_bytes // slot_bytes  # 0: every restore gets a one-off buffer
        self.stats = RestoreStats()
        self._kept = [_Kept() for _ in range(count)]
        # reentrant: a garbage collection inside a locked section may finalize a dropped lease, whose
        # callback takes this lock again on the same thread
        self._lock = threading.RLock()

    @property
    def capacities(self) -> list[int]:
        """Slots each kept buffer holds now (0: never used)."""
        with self._lock:
            return [k.capacity for k in self._kept]

    @property
    def held(self) -> int:
        """Kept buffers held by a lease now."""
        with self._lock:
            return sum(k.held for k in self._kept)

    def acquire(self, n: int) -> RestoreLease:
        """A lease of ``n`` slots for the caller alone until it releases it (contents: whatever was left).

        Takes a free kept buffer (the smallest that fits, else the largest, grown to
        ``min(max_slots, max(n, 2 * capacity))``), after synchronising on the copy that may still read
        it; a one-off buffer when every kept one is held or ``n > max_slots``. Never waits for a lease
        to be released. Call it off the engine thread (it may wait for the device and allocate).
        Mutates the free list and the counters. Failure: ValueError for ``n < 1``; an allocation
        error propagates with the buffer given back.
        """
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"n must be an int >= 1, got {n!r}")
        with self._lock:
            self.stats.acquired += 1
            free = [i for i, k in enumerate(self._kept) if not k.held]
            if n > self.max_slots or not free:
                self.stats.one_off += 1
                index = None
            else:
                fits = [i for i in free if self._kept[i].capacity >= n]
                pick = min if fits else max
                index = pick(fits or free, key=lambda i: self._kept[i].capacity)
                kept = self._kept[index]
                kept.held, done, kept.copy_done = True, kept.copy_done, None
                self.stats.waited_copies += done is not None
                self.stats.reused += bool(fits)
                self.stats.grown += not fits
        if index is None:  # pinning memory used once costs more than the pinned copy saves
            return RestoreLease(torch.empty(n * self.slot_bytes, dtype=torch.uint8), n, self.slot_bytes)
        try:
            if done is not None:
                done.synchronize()
            if kept.capacity < n:
                cap = min(self.max_slots, max(n, 2 * kept.capacity))
                kept.flat, kept.capacity = None, 0  # drop the old memory before taking more
                kept.flat = torch.empty(cap * self.slot_bytes, dtype=torch.uint8, pin_memory=self.pinned)
                kept.capacity = cap
        except BaseException:
            self._give_back(index, None)
            raise
        assert kept.flat is not None
        return RestoreLease(kept.flat, n, self.slot_bytes, _GiveBack(self, index))

    def _give_back(self, index: int, copy_done: CopyDone | None) -> None:
        with self._lock:
            kept = self._kept[index]
            kept.held, kept.copy_done = False, copy_done


@dataclass(frozen=True)
class _GiveBack:
    """``RestoreLease``'s callback into its buffer (a plain object: the finalizer may hold it)."""

    buffer: RestoreBuffer
    index: int

    def __call__(self, copy_done: CopyDone | None) -> None:
        self.buffer._give_back(self.index, copy_done)
