"""Positional reads into caller memory: ``preadv_full`` (scatter, no allocation) and ``prefetch``.

Why not ``os.pread``: it allocates a fresh bytes object per call, and fresh memory costs a page fault
per 4 KiB on first touch (on a virtual machine that returns freed memory to its host, as slow as
~1 GB/s), more than the disk takes to deliver the same bytes. ``os.preadv`` fills memory the reader
already owns: two reused buffers for ``get_many``, the caller's (pinned) buffer for ``get_many_into``.

Stateless; safe from any thread (each call names its own offset; nothing uses the file position).
"""

from __future__ import annotations

import os

_IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024


def preadv_full(fd: int, views: list[memoryview], offset: int) -> int:
    """Fill ``views`` in order with the bytes of ``fd`` from ``offset``; returns the bytes read, fewer
    than asked only where the file ends. Mutates the memory behind ``views`` (and ``views`` itself).

    Short reads are resumed (a signal, a read of more than the kernel's per-call limit); at most
    IOV_MAX views go to one call. Failure: OSError from the read; what was filled before it stays.
    """
    done, first = 0, 0
    while first < len(views):
        n = os.preadv(fd, views[first : first + _IOV_MAX], offset + done)
        if n == 0:
            break
        done += n
        while first < len(views) and n >= views[first].nbytes:  # drop what was filled
            n -= views[first].nbytes
            first += 1
        if n:
            views[first] = views[first][n:]
    return done


def prefetch(fd: int, offset: int, length: int) -> None:
    """Ask the kernel to start reading ``[offset, offset + length)`` into the page cache now, so the disk
    works on the next run while this thread verifies and copies the current one. Advice only: a file
    system that refuses it costs nothing (errors are ignored), and a disk reached with large readahead
    already streams ahead."""
    if length > 0 and hasattr(os, "posix_fadvise"):
        try:
            os.posix_fadvise(fd, offset, length, os.POSIX_FADV_WILLNEED)
        except OSError:
            pass
