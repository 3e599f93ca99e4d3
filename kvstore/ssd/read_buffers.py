"""ReadBuffers: the few read buffers an SSDReader reuses across ``get_many`` calls.

A fresh buffer per read would page-fault on every 4 KiB it receives (see ssd/read_io.py); a buffer
kept from the last call has its pages already. Each ``get_many`` leases two for its whole duration (one
is filled while the other is checked); at most ``keep`` idle buffers are kept (concurrent readers
allocate more, dropped again when given back), so the idle cost is ``keep * size`` bytes.

Thread-safe (its own small lock, never held across I/O).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from threading import Lock


class ReadBuffers:
    """A free list of ``size``-byte bytearrays, at most ``keep`` of them idle."""

    def __init__(self, size: int, keep: int = 2) -> None:
        """ValueError for ``size < 1`` or ``keep < 0``."""
        if size < 1:
            raise ValueError(f"size must be >= 1 byte, got {size}")
        if keep < 0:
            raise ValueError(f"keep must be >= 0, got {keep}")
        self.size = size
        self._keep = keep
        self._idle: list[bytearray] = []
        self._lock = Lock()

    @property
    def idle(self) -> int:
        return len(self._idle)

    @contextmanager
    def lease(self) -> Iterator[bytearray]:
        """A buffer of ``size`` bytes for the caller alone until the block exits (its contents are
        whatever the last user left). Mutates the free list on both ends."""
        with self._lock:
            buf = self._idle.pop() if self._idle else None
        if buf is None:
            buf = bytearray(self.size)
        try:
            yield buf
        finally:
            with self._lock:
                if len(self._idle) < self._keep:
                    self._idle.append(buf)
