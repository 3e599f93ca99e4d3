"""RestoredRun: the SSD block images one resume lookup restored, and their install into the pool.

The images sit in the first ``len(run)`` slots of a held host buffer (a ``RestoreLease``), each the
verified payload of one SSD record: a block's raw image, the same bytes ``GlobalKVPool.image`` wrote
(kvstore/layout.py), so installing is a byte copy into the pool's rows::

    host slots  [ img 0 | img 1 | ... | img k-1 ]        pinned on CUDA (RestoreBuffer)
                    | one copy (non_blocking from pinned memory)
    pool rows   data[block_ids[j]] = img j               one contiguous range: straight into the rows;
                                                         otherwise staged on the device, then index_copy_
                                                         (a CPU pool: one memcpy per run of consecutive ids)

``prefix`` shares the lease; ``install`` (or ``release``) gives it back, after which the run's images
are gone (RuntimeError). The engine thread owns a run once the lookup's future handed it over.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from flashtier.engine.tiers.restore_buffer import CopyDone, RestoreLease

# a scatter through a device staging tensor goes in pieces of at most this, so a very long restore
# never needs that much free device memory at once (one piece below ~4,700 real 57 KB blocks)
STAGE_BYTES = 256 << 20


class RestoredRun:
    """``count`` verified block images in slots of ``lease`` (None: an empty run)."""

    def __init__(self, lease: RestoreLease | None, count: int) -> None:
        """ValueError when ``count`` is negative or exceeds the lease's slots."""
        held = 0 if lease is None else lease.n
        if not 0 <= count <= held:
            raise ValueError(f"count must be in [0, {held}] (the lease's slots), got {count}")
        self._lease, self._count = lease, count

    @staticmethod
    def empty() -> RestoredRun:
        return RestoredRun(None, 0)

    @staticmethod
    def from_images(images: Sequence[bytes]) -> RestoredRun:
        """A run holding copies of ``images`` in plain memory (hand-built lookups, tests). ValueError when
        the images are empty bytes or of different lengths."""
        if not images:
            return RestoredRun.empty()
        size = len(images[0])
        if size < 1 or any(len(im) != size for im in images):
            raise ValueError(f"images must be non-empty and of one length, got {sorted({len(im) for im in images})}")
        host = torch.frombuffer(bytearray(b"".join(images)), dtype=torch.uint8)
        return RestoredRun(RestoreLease(host, len(images), size), len(images))

    def __len__(self) -> int:
        return self._count

    @property
    def slot_bytes(self) -> int:
        """Bytes per image (0 for a run without a lease)."""
        return 0 if self._lease is None else self._lease.slot_bytes

    @property
    def lease(self) -> RestoreLease | None:
        return self._lease

    def prefix(self, k: int) -> RestoredRun:
        """The first ``min(k, len)`` images (``k`` < 0 counts as 0), on the same lease."""
        return RestoredRun(self._lease, max(0, min(k, self._count)))

    def image(self, i: int) -> bytes:
        """Image ``i`` as bytes (tests, debugging). IndexError out of range; RuntimeError once released."""
        if not 0 <= i < self._count:
            raise IndexError(f"image {i} out of range for a run of {self._count}")
        assert self._lease is not None
        return self._lease.rows[i].numpy().tobytes()

    def release(self, copy_done: CopyDone | None = None) -> None:
        """Give the lease back (idempotent; a no-op without one)."""
        if self._lease is not None:
            self._lease.release(copy_done)

    def install(self, data: torch.Tensor, block_ids: Sequence[int]) -> None:
        """Copy image j into ``data[block_ids[j]]`` and give the lease back.

        ``data``: the pool's bytes, [num_blocks, slot_bytes] uint8 on any device. The copy is issued on
        the current stream, non_blocking (asynchronous from pinned memory); the lease is released with an
        event recorded after it, so the buffer is not refilled before the copy has read it.
        Mutates those rows of ``data``, and the lease (released even when the copy fails). Failure:
        ValueError when ``block_ids`` does not name one row per image, or ``data`` is not such a pool
        (then nothing is copied and the lease is kept); RuntimeError when the run was already released.
        """
        n = self._count
        if len(block_ids) != n:
            raise ValueError(f"block_ids names {len(block_ids)} rows for a run of {n} images")
        if n == 0:
            self.release()
            return
        if data.dtype != torch.uint8 or data.dim() != 2 or data.shape[1] != self.slot_bytes:
            raise ValueError(f"data must be a uint8 pool [num_blocks, {self.slot_bytes}], got {data.dtype} "
                             f"{tuple(data.shape)}")  # fmt: skip
        if min(block_ids) < 0 or max(block_ids) >= data.shape[0]:
            raise ValueError(f"block_ids must lie in [0, {data.shape[0]}), got {min(block_ids)}..{max(block_ids)}")
        assert self._lease is not None
        host = self._lease.rows[:n]
        try:
            _scatter(data, host, list(block_ids))
        finally:
            self.release(_copy_done(data.device))


def _scatter(data: torch.Tensor, host: torch.Tensor, ids: list[int]) -> None:
    """``data[ids[j]] = host[j]``: on a device, one host-to-device transfer per ``STAGE_BYTES`` (one in
    practice); on the CPU, one memcpy per run of consecutive block ids."""
    first, n = ids[0], len(ids)
    if data.device.type == "cpu":
        # numpy slice assignment is a plain memcpy; CPU index_copy_ of 57 KB rows ran ~15x slower (measured)
        dst, src = data.numpy(), host.numpy()
        for j, block_id, k in _runs(ids):
            dst[block_id : block_id + k] = src[j : j + k]
        return
    if ids == list(range(first, first + n)):  # fresh blocks in a row: straight into the pool's rows
        data[first : first + n].copy_(host, non_blocking=True)
        return
    per = max(1, STAGE_BYTES // host.shape[1])
    for a in range(0, n, per):
        rows = host[a : a + per].to(data.device, non_blocking=True)  # the same tensor on the CPU: no copy
        where = torch.tensor(ids[a : a + per], dtype=torch.long)
        if data.is_cuda:  # from pageable memory the driver may wait for the stream: stage the ids pinned
            where = where.pin_memory().to(data.device, non_blocking=True)
        data.index_copy_(0, where, rows)


def _runs(ids: list[int]) -> list[tuple[int, int, int]]:
    """(index into ``ids``, first block id, length) of each run of consecutive block ids."""
    out, j = [], 0
    for i in range(1, len(ids) + 1):
        if i == len(ids) or ids[i] != ids[i - 1] + 1:
            out.append((j, ids[j], i - j))
            j = i
    return out


def _copy_done(device: torch.device) -> CopyDone | None:
    """An event after the copies just issued on ``device`` (None off CUDA: those copies were synchronous)."""
    if device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event
