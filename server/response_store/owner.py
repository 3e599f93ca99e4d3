"""Whose stored responses are whose: the owner digest of an API key, and deleting one owner's records.

A stored response (store.py) records its ``owner``: under ``--cache-isolation per-key`` the digest
``sha256(OWNER_DOMAIN + key)`` hex of the API key that made it (server/responses/route.py derives it the
same way; tests/server/test_tenant_delete.py holds the two to the same value), else None (any client,
so not attributable to a tenant). Deleting a tenant by its API key removes the records of that owner.

``delete_owner_files`` is the disk backend's deletion, shared by the running server and ``flashtier kv
wipe`` (on a stopped server's directory): each record file selected is overwritten with zeros, fsynced and
unlinked, then the directory is fsynced, so its conversation is in no file when it returns.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

from flashtier.server.response_store.store import StoredResponse

__all__ = ["OWNER_DOMAIN", "OwnerDeletion", "count_files", "delete_owner_files", "response_owner", "responses_dir"]

OWNER_DOMAIN = b"flashtier/response-owner/v1\x00"
RESPONSES_DIR = "responses"
SUFFIX = ".json"


def response_owner(api_key: str) -> str:
    """The ``owner`` of the responses an API key stores under per-key isolation."""
    return hashlib.sha256(OWNER_DOMAIN + api_key.encode("utf-8")).hexdigest()


def responses_dir(kv_dir: str | os.PathLike[str]) -> Path:
    """Where the disk backend keeps the records of the server whose ``--kv-dir`` is ``kv_dir``."""
    return Path(kv_dir) / RESPONSES_DIR


@dataclass(slots=True)
class OwnerDeletion:
    """Records (files) removed, or with ``dry_run`` that would be, and their bytes."""

    records: int = 0
    bytes: int = 0
    unreadable: int = 0  # files that are not a valid record (removed too when ``everything``)


def _shred(path: str, size: int) -> None:
    """Overwrite ``path`` with zeros, fsync, unlink (the caller fsyncs the directory). OSError on failure."""
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    try:
        zeros, done = bytes(min(size, 1 << 20)), 0
        while done < size:
            done += os.pwrite(fd, zeros[: size - done], done)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.unlink(path)


def delete_owner_files(directory: str | os.PathLike[str], owner: str | None, *, everything: bool = False,
                       dry_run: bool = False) -> OwnerDeletion:  # fmt: skip
    """Remove the record files in ``directory`` whose owner is ``owner`` (every record file and temp file
    with ``everything``). Mutates the directory unless ``dry_run``; a missing directory holds nothing.
    Failure: OSError from the file system (the files before it are gone)."""
    out = OwnerDeletion()
    path = Path(directory)
    try:
        entries = list(os.scandir(path))
    except FileNotFoundError:
        return out
    for entry in entries:
        is_record = entry.name.endswith(SUFFIX) and not entry.name.startswith(".")
        if not (is_record or (everything and entry.name.endswith(".tmp"))):
            continue
        try:
            raw = Path(entry.path).read_bytes()
        except FileNotFoundError:
            continue
        if not everything:
            try:
                if StoredResponse.from_json(raw).owner != owner:
                    continue
            except ValueError:
                out.unreadable += 1
                continue
        out.records += is_record
        out.bytes += len(raw)
        if not dry_run:
            _shred(entry.path, len(raw))
    if not dry_run and out.records:
        dir_fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    return out


def count_files(directory: str | os.PathLike[str]) -> OwnerDeletion:
    """Record files in ``directory`` and their bytes (``kv stats``); reads only."""
    return delete_owner_files(directory, None, everything=True, dry_run=True)
