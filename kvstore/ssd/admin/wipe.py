"""wipe_tier: remove the records an operator selects from an SSD tier no store has open (``flashtier kv wipe``).

Per segment, by what the selection leaves in it::

    nothing selected            untouched
    every record selected       the file is unlinked (damaged ranges and torn tail go with it)
    some records selected       rewritten: the records kept are copied byte-identical (same created_at,
                                so their lifetime does not restart) into a new segment with the next id,
                                then the old file is unlinked

A rewrite writes ``<name>.wipe-tmp`` (a name the store ignores), fsyncs it, renames it to its segment
name, fsyncs the directory, and only then unlinks the source and fsyncs the directory again. A crash
leaves either the source alone (and maybe an ignored temp file, removed by the next wipe) or both
copies; both copies read back as one entry per key (the newer segment id wins a tie in created_at), and
the selected records survive only until the wipe is run again. A kept record that fails its checksum is
dropped instead of copied (the store would never serve it).

Takes the store's ``LOCK`` exclusively for the whole run (ssd/admin/lock.py): a store cannot open the
directory meanwhile, and a wipe refuses a directory a store holds.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from flashtier.kvstore.ssd.admin.lock import store_lock
from flashtier.kvstore.ssd.admin.scan import ScannedSegment, TierScan, scan_tier
from flashtier.kvstore.ssd.record import RecordCorrupt, RecordHeader, decode_record
from flashtier.kvstore.ssd.segment import FILE_MODE, segment_name

__all__ = ["TEMP_SUFFIX", "WipeResult", "wipe_tier"]

TEMP_SUFFIX = ".wipe-tmp"
Select = Callable[[RecordHeader], bool]


@dataclass(slots=True)
class WipeResult:
    """What a wipe did (or, with ``dry_run``, would do)."""

    records_removed: int = 0
    bytes_removed: int = 0  # record bytes of the removed records
    records_kept: int = 0
    segments_deleted: int = 0
    segments_rewritten: int = 0
    corrupt_dropped: int = 0  # kept records that failed their checks while being copied
    bytes_freed: int = 0  # segment file bytes before minus after
    unattributed_removed: int = 0  # bytes of version-1 records, damaged ranges and torn tails dropped


def _fsync_dir(dir_fd: int) -> None:
    os.fsync(dir_fd)


def _rewrite(seg: ScannedSegment, keep: list[tuple[int, RecordHeader]], new_id: int, dir_fd: int,
             result: WipeResult) -> int:
    """Copy ``keep`` into segment ``new_id`` (see the module doc); returns the new file's size."""
    final = seg.path.with_name(segment_name(new_id))
    temp = final.with_name(final.name + TEMP_SUFFIX)
    src = os.open(seg.path, os.O_RDONLY | os.O_CLOEXEC)
    dst = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, FILE_MODE)
    written = 0
    try:
        os.fchmod(dst, FILE_MODE)
        for offset, header in keep:
            raw = os.pread(src, header.record_bytes, offset)
            try:
                decode_record(raw, header.key)
            except RecordCorrupt:
                result.corrupt_dropped += 1
                result.records_kept -= 1
                continue
            view = memoryview(raw)
            while view:
                view = view[os.write(dst, view):]
            written += len(raw)
        os.fsync(dst)
    except BaseException:
        os.close(dst)
        os.unlink(temp)
        raise
    finally:
        os.close(src)
    os.close(dst)
    os.rename(temp, final)
    _fsync_dir(dir_fd)
    return written


def wipe_tier(directory: str | os.PathLike[str], select: Select, *, dry_run: bool = False,
              drop_unattributed: bool = False) -> WipeResult:
    """Remove every record for which ``select(header)`` is true (see the module doc).

    ``drop_unattributed`` (a tenant's wipe): a segment also counts as selected-from when it holds bytes no
    tenant can be proven to own (version-1 records, damaged ranges, a torn tail): it is rewritten without
    them, so none of the tenant's bytes can stay behind in them.

    Mutates the directory's segment files unless ``dry_run`` (then it only counts). Failure:
    ``TierInUse`` when a store holds the directory; ValueError when it is not a directory; OSError from
    the file system, after which every segment is either untouched, deleted or fully rewritten.
    """
    path = Path(directory)
    if not path.is_dir():
        raise ValueError(f"{path} is not a directory")
    result = WipeResult()
    with store_lock(path, exclusive=not dry_run):
        scan: TierScan = scan_tier(path)
        next_id = max((s.segment_id for s in scan.segments), default=0) + 1
        dir_fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            if not dry_run:
                for name in os.listdir(path):
                    if name.endswith(TEMP_SUFFIX):  # left by a wipe that died before its rename
                        os.unlink(path / name)
            for seg in scan.segments:
                chosen = [select(h) for _, h in seg.records]
                keep = [rec for rec, c in zip(seg.records, chosen) if not c]
                result.records_kept += len(keep)
                if len(keep) == len(seg.records) and not (drop_unattributed and seg.unattributed_bytes):
                    continue
                result.unattributed_removed += seg.unattributed_bytes
                result.records_removed += len(seg.records) - len(keep)
                result.bytes_removed += sum(h.record_bytes for (_, h), c in zip(seg.records, chosen) if c)
                size = sum(h.record_bytes for _, h in keep)
                if keep:
                    result.segments_rewritten += 1
                    if not dry_run:
                        size = _rewrite(seg, keep, next_id, dir_fd, result)
                    next_id += 1
                else:
                    result.segments_deleted += 1
                result.bytes_freed += seg.size - size
                if not dry_run:
                    os.unlink(seg.path)
                    _fsync_dir(dir_fd)
        finally:
            os.close(dir_fd)
    return result
