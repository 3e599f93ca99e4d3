"""DiskResponseStore: the response store beside the SSD tier, ``<kv-dir>/responses/<id>.json``.

The directory is created (0700) at the first write, so a server that never stores a response leaves no
trace. A write is atomic: the record goes to ``.<id>.<random>.tmp`` (0600, O_EXCL), is fsynced, renamed
over ``<id>.json`` and the directory fsynced; a crash leaves either the whole old state or the whole new
one (and at worst a temp file, swept later). A record expires ``ttl_s`` after its file was written
(its mtime, so the TTL in force when it is read applies): ``get`` treats an expired file as absent and
removes it, and a sweep of the directory (at the first write, then at most every ``sweep_interval_s``,
in the background) removes the expired records and stale temp files nobody asks for.

Every file operation runs on a worker thread (``asyncio.to_thread``), never on the event loop. OSError
is a counted, logged-once failure (responses/store.py), never an exception to the caller; a file that is
not a valid record is counted as corrupt, removed, and treated as absent.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import time
from collections.abc import Callable
from pathlib import Path

from flashtier.server.response_store.owner import delete_owner_files
from flashtier.server.response_store.store import DEFAULT_TTL_S, ResponseStore, StoredResponse, is_response_id

__all__ = ["DiskResponseStore"]

logger = logging.getLogger(__name__)

DIR_MODE = 0o700
FILE_MODE = 0o600
SUFFIX = ".json"
STALE_TEMP_S = 3600.0  # a temp file this old belongs to a write that died


class DiskResponseStore(ResponseStore):
    backend = "disk"

    def __init__(self, kv_dir: str | os.PathLike[str], *, ttl_s: float = DEFAULT_TTL_S,
                 sweep_interval_s: float | None = None, clock: Callable[[], float] = time.time) -> None:
        super().__init__(ttl_s)
        self.dir = Path(kv_dir) / "responses"
        self.sweep_interval_s = sweep_interval_s if sweep_interval_s is not None else min(600.0, max(1.0, ttl_s / 2))
        self._clock = clock
        self._next_sweep = 0.0  # the first write sweeps what an earlier run left
        self._sweep: asyncio.Task[int] | None = None
        self.swept = 0  # records removed by sweeps and by expired reads

    def _path(self, response_id: str) -> Path:
        return self.dir / (response_id + SUFFIX)

    async def put(self, record: StoredResponse) -> bool:
        """Write `record` (replacing one with its id); False when the disk refused (counted, logged once)."""
        if not is_response_id(record.id):
            raise ValueError(f"not a response id: {record.id!r}")
        data = record.to_json()
        try:
            await asyncio.to_thread(self._write, record.id, data)
        except OSError as exc:
            self._failed("put", exc)
            return False
        self._ok("put")
        self._maybe_sweep()
        return True

    async def get(self, response_id: str) -> StoredResponse | None:
        """The record, or None (unknown, expired, unreadable or corrupt)."""
        if not is_response_id(response_id):
            return None
        try:
            raw = await asyncio.to_thread(self._read, response_id)
        except OSError as exc:
            self._failed("get", exc)
            return None
        self._ok("get")
        if raw is None:
            return None
        try:
            return StoredResponse.from_json(raw)
        except ValueError:
            self.stats.errors["corrupt"] += 1
            logger.warning("response store: %s is not a valid record; removed", self._path(response_id))
            await asyncio.to_thread(self._unlink, response_id)
            return None

    async def delete(self, response_id: str) -> bool:
        """Remove the record; True when there was one (an expired one counts as absent)."""
        if not is_response_id(response_id):
            return False
        try:
            removed = await asyncio.to_thread(self._remove, response_id)
        except OSError as exc:
            self._failed("delete", exc)
            return False
        self._ok("delete")
        return removed

    async def delete_owner(self, owner: str) -> int:
        """Overwrite, fsync and unlink every record file of ``owner`` (owner.py), on a worker thread."""
        return (await asyncio.to_thread(delete_owner_files, self.dir, owner)).records

    async def close(self) -> None:
        if self._sweep is not None:
            await asyncio.gather(self._sweep, return_exceptions=True)

    # ---- on the worker thread ---------------------------------------------------------------------------

    def _write(self, response_id: str, data: bytes) -> None:
        if not self.dir.is_dir():
            self.dir.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
            os.chmod(self.dir, DIR_MODE)  # mkdir's mode is filtered by the umask
        tmp = self.dir / f".{response_id}.{secrets.token_hex(4)}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, FILE_MODE)
        try:
            try:
                os.fchmod(fd, FILE_MODE)
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view):]
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, self._path(response_id))
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        dir_fd = os.open(self.dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(dir_fd)  # the rename itself is durable only once the directory is
        finally:
            os.close(dir_fd)

    def _read(self, response_id: str) -> bytes | None:
        path = self._path(response_id)
        try:
            if os.stat(path).st_mtime + self.ttl_s <= self._clock():
                path.unlink(missing_ok=True)
                self.swept += 1
                return None
            return path.read_bytes()
        except FileNotFoundError:
            return None

    def _remove(self, response_id: str) -> bool:
        """Unlink the record; True when it was there and not expired."""
        path = self._path(response_id)
        try:
            live = os.stat(path).st_mtime + self.ttl_s > self._clock()
            path.unlink()
        except FileNotFoundError:
            return False
        return live

    def _unlink(self, response_id: str) -> bool:
        try:
            self._path(response_id).unlink()
            return True
        except FileNotFoundError:
            return False

    def sweep(self) -> int:
        """Remove expired records and stale temp files; the number of records removed (worker thread)."""
        now, removed = self._clock(), 0
        try:
            entries = list(os.scandir(self.dir))
        except FileNotFoundError:
            return 0
        for entry in entries:
            try:
                age = now - entry.stat().st_mtime
                if entry.name.endswith(SUFFIX) and age >= self.ttl_s:
                    os.unlink(entry.path)
                    removed += 1
                elif entry.name.endswith(".tmp") and age >= STALE_TEMP_S:
                    os.unlink(entry.path)
            except FileNotFoundError:
                continue  # a concurrent get or delete took it
        self.swept += removed
        return removed

    def _maybe_sweep(self) -> None:
        now = self._clock()
        if now < self._next_sweep or (self._sweep is not None and not self._sweep.done()):
            return
        self._next_sweep = now + self.sweep_interval_s
        self._sweep = asyncio.ensure_future(asyncio.to_thread(self.sweep))
        self._sweep.add_done_callback(self._swept)

    def _swept(self, task: asyncio.Task[int]) -> None:
        if not task.cancelled() and task.exception() is not None:
            exc = task.exception()
            assert exc is not None
            self._failed("sweep", exc)
