"""KVDirLock: one ``flashtier serve`` per SSD directory, found out before the model loads.

The SSD store flocks ``KV_DIR/LOCK`` only once the engine is built, minutes into a start; a second server
on the same directory (two demo servers share CACHE_DIR/kv/demo-tiny) would load its model first and then
fail. So ``serve`` takes an exclusive ``flock`` on ``KV_DIR/SERVER.LOCK`` right after its settings are
checked, writes its pid there and holds it until it exits (the kernel drops the lock when the process
dies, so a crash leaves nothing to clean up). A second server finds the lock held and stops with one line
naming the holder's pid; ``held_by`` lets the start-up checks say the same before they touch the store's
own LOCK.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

__all__ = ["SERVER_LOCK_NAME", "KVDirInUse", "KVDirLock", "held_by"]

SERVER_LOCK_NAME = "SERVER.LOCK"


class KVDirInUse(ValueError):
    """Another flashtier process holds the directory; ``str()`` is the one line ``serve`` prints."""

    def __init__(self, kv_dir: str | os.PathLike[str], pid: int | None) -> None:
        self.pid = pid
        who = f"pid {pid}" if pid else "pid unknown"
        super().__init__(f"--kv-dir {kv_dir} is in use by another flashtier process ({who}); pass --kv-dir to use "
                         "another directory")


def _read_pid(fd: int) -> int | None:
    try:
        text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
        return int(text) if text.isdigit() else None
    except OSError:
        return None


def held_by(kv_dir: str | os.PathLike[str]) -> int | None:
    """The pid written by the process holding ``KV_DIR/SERVER.LOCK`` (0 when it wrote none yet), or None
    when no process holds it. Probes with a shared non-blocking lock, released at once."""
    try:
        fd = os.open(Path(kv_dir) / SERVER_LOCK_NAME, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return _read_pid(fd) or 0
    except OSError:
        return None
    finally:
        os.close(fd)
    return None


class KVDirLock:
    """The held lock; ``release()`` (or process exit) gives it up."""

    def __init__(self, fd: int, path: Path) -> None:
        self._fd: int | None = fd
        self.path = path

    @classmethod
    def acquire(cls, kv_dir: str | os.PathLike[str]) -> KVDirLock:
        """Lock ``KV_DIR/SERVER.LOCK`` (the directory must exist) and write this pid into it.

        Raises ``KVDirInUse`` when another process holds it, ``ValueError`` when the file cannot be opened.
        """
        path = Path(kv_dir) / SERVER_LOCK_NAME
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            raise ValueError(f"--kv-dir {kv_dir}: cannot open {path} ({exc.strerror or exc}); pass a writable "
                             "--kv-dir, or run without the SSD tier: --no-kv-persist") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            pid = _read_pid(fd)
            os.close(fd)
            raise KVDirInUse(kv_dir, pid) from None
        except BaseException:
            os.close(fd)
            raise
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode("ascii"), 0)
        return cls(fd, path)

    def release(self) -> None:
        """Empty the pid and drop the lock; idempotent."""
        if self._fd is None:
            return
        try:
            os.ftruncate(self._fd, 0)
        except OSError:
            pass
        os.close(self._fd)
        self._fd = None
