"""Reading records back out of segment files: coalesced runs, payload verification, header checks.

Shared by every path that reads records (SSDReader's get_many, the RefreshQueue's re-append, the
Compactor's copies, check_integrity(deep=True)); none of them serves or copies a record that fails here.
A record is trusted only when its checksum holds *and* its header matches the index entry that led to
it (key, payload length): a stale entry pointing at reused or damaged bytes is a miss, never a wrong hit.

Pure functions over bytes, except ``check_header`` (one pread on a segment the caller keeps open).
"""

from __future__ import annotations

from collections.abc import Iterator

from flashtier.kvstore.block_hash import BlockHash
from flashtier.kvstore.ssd.index import IndexEntry
from flashtier.kvstore.ssd.record import HEADER_BYTES, RecordCorrupt, decode_header, decode_record
from flashtier.kvstore.ssd.segment import Segment

MAX_READ_BYTES = 64 << 20  # cap on one coalesced read

Located = tuple[BlockHash, IndexEntry]  # a key and where its newest record is (SSDIndex.segment_entries)


def coalesce_runs(entries: list[Located], gap: int) -> Iterator[list[Located]]:
    """Group entries of one segment into runs read by one pread: sorted by offset, each starting at
    most ``gap`` bytes after the previous one's end, each run at most MAX_READ_BYTES."""
    run: list[Located] = []
    for key, entry in sorted(entries, key=lambda kv: kv[1].offset):
        if run and (entry.offset - run[-1][1].end > gap or entry.end - run[0][1].offset > MAX_READ_BYTES):
            yield run
            run = []
        run.append((key, entry))
    if run:
        yield run


def verified_payload(data: bytes, rel: int, key: BlockHash, entry: IndexEntry) -> bytes | None:
    """The payload of the record at ``data[rel:]`` if it is intact and is the one ``entry`` describes."""
    try:
        payload = decode_record(memoryview(data)[rel : rel + entry.record_bytes], key)
    except RecordCorrupt:
        return None
    return payload if len(payload) == entry.length else None


def check_header(seg: Segment, key: BlockHash, entry: IndexEntry) -> None:
    """RuntimeError unless the header at ``entry`` is intact and describes ``key``/``entry``."""
    try:
        header = decode_header(seg.read(entry.offset, HEADER_BYTES))
    except RecordCorrupt as exc:
        raise RuntimeError(f"{key!r} at {entry}: {exc}") from None
    if (header.key, header.length, header.created_at) != (key, entry.length, entry.created_at):
        raise RuntimeError(f"{key!r} at {entry}: header says {header}")
