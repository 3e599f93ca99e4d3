"""TierReport: what ``flashtier kv stats`` prints about an SSD tier, computed from a TierScan.

The numbers use the store's own rules (ssd/store.py): a record is *live* when the index points at it,
*young* while its age (now - created_at) is below the lifetime (never evicted: what admission control
cannot free), *expired* after. Dead bytes (superseded records), damaged ranges and torn tails are
garbage that the store reclaims by deleting or compacting segments.

Records carry the tag of the tenant (namespace) they were written under (ssd/record.py, kvstore/tenant.py):
``namespaces`` splits records and live entries by tag (the default tenant, requests without a
cache_salt, is labelled). Version-1 records (no tenant) are counted apart: never served, garbage.

Only headers are read (the scan): a record whose payload is damaged is counted as a record here;
``kv verify`` reads every payload and names it (``damaged_note`` says so in the output).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from flashtier.kvstore.ssd.admin.scan import TierScan
from flashtier.kvstore.tenant import DEFAULT_TENANT_TAG

__all__ = ["AgeBucket", "DAMAGED_NOTE", "NamespaceUsage", "TierReport", "age_edges", "tier_report"]

DAMAGED_NOTE = "headers only: damaged payloads are found by `flashtier kv verify`, which reads every record"
_EDGES_S = (300.0, 3600.0, 6 * 3600.0, 24 * 3600.0, 48 * 3600.0)  # bucket edges below the lifetime


def age_edges(lifetime_s: float) -> list[float]:
    """Bucket upper edges in seconds: 5m, 1h, 6h, 24h, 48h (those below the lifetime), then the lifetime."""
    return [e for e in _EDGES_S if e < lifetime_s] + [lifetime_s]


@dataclass(frozen=True, slots=True)
class AgeBucket:
    """Live entries whose age lies in [low_s, high_s) (high_s None: the lifetime and beyond, expired)."""

    low_s: float
    high_s: float | None
    entries: int
    bytes: int


@dataclass(frozen=True, slots=True)
class NamespaceUsage:
    """One tenant's records in the tier (``tag``: hex of its 16-byte tag, kvstore/tenant.py)."""

    tag: str
    default: bool  # the default tenant (requests without a cache_salt)
    entries: int  # live records
    live_bytes: int
    records: int  # every record of the tenant, superseded ones included (all of them are deleted with it)
    record_bytes: int


@dataclass(frozen=True, slots=True)
class TierReport:
    """Sizes in bytes (record bytes: header + payload), ages in seconds, at the moment ``now``."""

    directory: str
    segments: int
    bytes_on_disk: int  # every segment file byte
    entries: int  # live records (one per key)
    live_bytes: int
    dead_bytes: int  # superseded records: reclaimed by compaction
    damaged_bytes: int  # ranges skipped over damaged headers (``kv verify`` names them)
    torn_bytes: int  # tails of records cut short by a crash (harmless)
    budget_bytes: int
    lifetime_s: float
    young_bytes: int  # live bytes inside the lifetime: never evicted
    expired_bytes: int  # live bytes past the lifetime: evicted when a write needs room
    oldest_age_s: float | None  # of a live record; None when empty
    newest_age_s: float | None
    ages: list[AgeBucket] = field(default_factory=list)
    namespaces: list[NamespaceUsage] = field(default_factory=list)  # most bytes first
    legacy_records: int = 0  # version-1 records (no tenant): never served, garbage
    legacy_bytes: int = 0
    damaged_note: str = DAMAGED_NOTE

    @property
    def used_fraction(self) -> float:
        """Disk bytes over the budget (above 1: the budget was lowered below what is on disk)."""
        return self.bytes_on_disk / self.budget_bytes


def tier_report(scan: TierScan, *, now: float, budget_bytes: int, lifetime_s: float) -> TierReport:
    """The report of ``scan`` at time ``now`` (seconds on the store clock: wall time) for a store run with
    ``budget_bytes`` and ``lifetime_s``. ValueError for a non-positive budget or lifetime."""
    if budget_bytes <= 0:
        raise ValueError(f"budget_bytes must be > 0, got {budget_bytes}")
    if not lifetime_s > 0:
        raise ValueError(f"lifetime_s must be > 0, got {lifetime_s}")
    edges = age_edges(lifetime_s)
    counts = [[0, 0] for _ in range(len(edges) + 1)]
    live_bytes = young = 0
    ages: list[float] = []
    for _, entry in scan.index.items():
        age = max(0.0, now - entry.created_at)
        ages.append(age)
        live_bytes += entry.record_bytes
        if age < lifetime_s:
            young += entry.record_bytes
        slot = next((i for i, edge in enumerate(edges) if age < edge), len(edges))
        counts[slot][0] += 1
        counts[slot][1] += entry.record_bytes
    lows = [0.0, *edges]
    buckets = [AgeBucket(lows[i], edges[i] if i < len(edges) else None, n, b) for i, (n, b) in enumerate(counts)]
    record_bytes = sum(h.record_bytes for s in scan.segments for _, h in s.records)
    per_ns: dict[bytes, list[int]] = {}
    for seg in scan.segments:
        for offset, h in seg.records:
            row = per_ns.setdefault(h.tenant, [0, 0, 0, 0])
            row[2] += 1
            row[3] += h.record_bytes
            if scan.is_live(seg.segment_id, offset, h):
                row[0] += 1
                row[1] += h.record_bytes
    namespaces = sorted((NamespaceUsage(t.hex(), t == DEFAULT_TENANT_TAG, *row) for t, row in per_ns.items()),
                        key=lambda n: (-n.record_bytes, n.tag))
    return TierReport(
        directory=str(scan.directory),
        segments=len(scan.segments),
        bytes_on_disk=scan.bytes,
        entries=len(scan.index),
        live_bytes=live_bytes,
        dead_bytes=record_bytes - live_bytes,
        damaged_bytes=sum(end - start for s in scan.segments for start, end in s.damaged),
        torn_bytes=sum(s.scan.torn_bytes for s in scan.segments),
        budget_bytes=budget_bytes,
        lifetime_s=lifetime_s,
        young_bytes=young,
        expired_bytes=live_bytes - young,
        oldest_age_s=max(ages) if ages else None,
        newest_age_s=min(ages) if ages else None,
        ages=buckets,
        namespaces=namespaces,
        legacy_records=sum(len(s.scan.legacy) for s in scan.segments),
        legacy_bytes=sum(s.scan.legacy_bytes for s in scan.segments),
    )
