"""The tier counters and gauges as one flat mapping for ``EngineStats.tiers`` (the server's /metrics)."""

from __future__ import annotations

from flashtier.engine.tiers import TierManager

_SSD = ("bytes", "entries", "oldest_entry_age_s", "admission_refusals", "expirations", "corrupt_records",
        "bytes_read", "bytes_written", "hits", "misses")
_SNAPSHOT = ("hits", "misses", "errors", "corrupt", "bytes_written", "bytes_read", "redis_errors")


def tier_stats(tiers: TierManager | None) -> dict[str, float]:
    """Reads counters without a lock (a slightly stale snapshot is fine for metrics)."""
    if tiers is None:
        return {}
    t = tiers.stats
    out: dict[str, float] = {
        "ssd_blocks_written": t.ssd_blocks_written, "ssd_bytes_written": t.ssd_bytes_written,
        "ssd_write_refused": t.ssd_write_refused, "ssd_blocks_loaded": t.ssd_blocks_loaded,
        "snapshot_puts": t.snapshot_puts, "snapshot_bytes_written": t.snapshot_bytes_written,
    }
    for outcome, n in t.snapshot_lookups.items():
        out[f"snapshot_lookup_{outcome.value}"] = n
    if tiers.ssd is not None:
        s = tiers.ssd.stats()
        for name in _SSD:
            out[f"ssd_{name}"] = getattr(s, name)
    ps = tiers.snapshots.stats()
    for name in _SNAPSHOT:
        out[f"snapshot_{name}"] = getattr(ps, name)
    return out
