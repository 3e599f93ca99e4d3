"""store_lock: the SSD store's own directory lock (``KV_DIR/LOCK``), taken by the operator tools.

An open SSDStore holds an exclusive ``flock`` on ``LOCK`` for its lifetime (ssd/store.py). The tools
take the same lock: shared to read (``kv stats``, ``kv verify``: refused while a store has the directory
open, several readers at once are fine), exclusive to change files (``kv wipe``: a store cannot open the
directory until the wipe is done). The kernel drops the lock when the process dies.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from flashtier.kvstore.ssd.segment import FILE_MODE

__all__ = ["STORE_LOCK_NAME", "TierInUse", "store_lock"]

STORE_LOCK_NAME = "LOCK"


class TierInUse(RuntimeError):
    """A store (a running server, most likely) holds the directory's LOCK."""


@contextmanager
def store_lock(directory: str | os.PathLike[str], *, exclusive: bool) -> Iterator[None]:
    """Hold ``directory/LOCK`` (shared or exclusive) for the ``with`` block.

    A shared lock on a directory without LOCK holds nothing (no store ever opened it) and creates no
    file; an exclusive one creates LOCK (0600) as the store would. Failure: ``TierInUse`` when a store
    holds it, OSError when the file cannot be opened. Never blocks.
    """
    path = Path(directory) / STORE_LOCK_NAME
    if exclusive:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, FILE_MODE)
    elif path.exists():
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    else:  # no store ever opened the directory (one that does meanwhile only makes a read stale)
        yield
        return
    try:
        try:
            fcntl.flock(fd, (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB)
        except BlockingIOError:
            raise TierInUse(f"{Path(directory)} is open by an SSD store ({STORE_LOCK_NAME} is held)") from None
        yield
    finally:
        os.close(fd)
