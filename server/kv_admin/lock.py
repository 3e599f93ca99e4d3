"""admin_access: the locks ``flashtier kv`` takes on an SSD directory before it reads or changes it.

Two locks guard a directory (see kv_dir_lock.py and kvstore/ssd/admin/lock.py)::

    SERVER.LOCK   held by ``flashtier serve`` from start-up to exit (its pid inside)
    LOCK          held by the SSD store the server's engine opens

Reading (stats, verify) probes SERVER.LOCK and holds LOCK shared; changing files (wipe) holds both
exclusively, so a server started meanwhile stops at start-up naming this process. Either way a
directory in use ends the command with one line (``KVDirHeld``, a ValueError: exit status 2) and
nothing is read or changed.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from flashtier.kvstore.ssd.admin.lock import TierInUse, store_lock
from flashtier.server.config.kv_dir_lock import KVDirInUse, KVDirLock, held_by

__all__ = ["KVDirHeld", "admin_access"]


class KVDirHeld(ValueError):
    """A live process holds the directory; ``str()`` is the line the CLI prints."""

    def __init__(self, kv_dir: str | os.PathLike[str], pid: int | None) -> None:
        who = f"a running flashtier server (pid {pid})" if pid else "a running flashtier server or SSD store"
        super().__init__(f"--kv-dir {kv_dir} is held by {who}; stop it first (flashtier kv never works on a "
                         "live SSD tier)")
        self.pid = pid


@contextmanager
def admin_access(kv_dir: str | os.PathLike[str], *, write: bool) -> Iterator[None]:
    """Hold the locks for reading (``write`` False) or changing ``kv_dir`` during the ``with`` block.

    Creates ``SERVER.LOCK`` (with this pid, emptied on exit) only when ``write``. Failure: KVDirHeld when
    a server or store holds the directory; ValueError when ``kv_dir`` is not a directory.
    """
    path = Path(kv_dir)
    if not path.is_dir():
        raise ValueError(f"--kv-dir {kv_dir}: not a directory; pass the directory `flashtier serve` uses "
                         "(its --kv-dir, or $FLASHTIER_KV_DIR)")
    if not write:
        pid = held_by(path)
        if pid is not None:
            raise KVDirHeld(kv_dir, pid)
        try:
            with store_lock(path, exclusive=False):
                yield
        except TierInUse:
            raise KVDirHeld(kv_dir, None) from None
        return
    try:
        server_lock = KVDirLock.acquire(path)
    except KVDirInUse as exc:
        raise KVDirHeld(kv_dir, exc.pid) from None
    try:
        yield
    except TierInUse:  # the wipe's own exclusive LOCK
        raise KVDirHeld(kv_dir, None) from None
    finally:
        server_lock.release()
