"""The text ``flashtier kv`` prints for people (``--json`` prints the dataclasses instead)."""

from __future__ import annotations

from flashtier.kvstore.ssd.admin.report import TierReport
from flashtier.kvstore.ssd.admin.verify import VerifyReport
from flashtier.kvstore.ssd.admin.wipe import WipeResult
from flashtier.server.config.options import format_size

__all__ = ["format_age", "format_bytes", "format_report", "format_verify", "format_wipe"]

MAX_LISTED = 50  # bad records printed one per line; the JSON output lists them all


def format_bytes(n: int) -> str:
    """``1,234,567 B (1.2 MiB)``: exact, then readable."""
    for unit, scale in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n:,} B ({n / scale:.1f} {unit})"
    return f"{n:,} B"


def format_age(seconds: float | None) -> str:
    """``3d 4h``, ``72h`` is ``3d``, ``2h 5m``, ``5m``, ``42s``; ``-`` for None."""
    if seconds is None:
        return "-"
    s = int(seconds)
    for big, big_unit, small, small_unit in ((86400, "d", 3600, "h"), (3600, "h", 60, "m"), (60, "m", 1, "s")):
        if s >= big:
            rest = s % big // small
            return f"{s // big}{big_unit}" + (f" {rest}{small_unit}" if rest else "")
    return f"{s}s"


def _percent(fraction: float) -> str:
    pct = 100 * fraction
    return "0%" if pct == 0 else "< 0.1%" if pct < 0.1 else f"{pct:.1f}%"


def format_report(r: TierReport) -> str:
    lines = [
        f"SSD tier {r.directory}",
        f"  segments        {r.segments}, {format_bytes(r.bytes_on_disk)} on disk",
        f"  budget          {format_size(r.budget_bytes)}: {_percent(r.used_fraction)} used",
        f"  entries         {r.entries:,} live, {format_bytes(r.live_bytes)}",
        f"    young         {format_bytes(r.young_bytes)} inside the {format_age(r.lifetime_s)} lifetime (never "
        "evicted)",
        f"    expired       {format_bytes(r.expired_bytes)} (evicted when a write needs room)",
        f"  garbage         dead {format_bytes(r.dead_bytes)}, damaged headers {format_bytes(r.damaged_bytes)}, torn "
        f"{format_bytes(r.torn_bytes)}, version-1 records {r.legacy_records:,} ({format_bytes(r.legacy_bytes)})",
        f"                  ({r.damaged_note})",
        f"  oldest entry    {format_age(r.oldest_age_s)} old; newest {format_age(r.newest_age_s)} old",
        f"  namespaces      {len(r.namespaces)} (tenant tags; `kv wipe --namespace NS | --api-key KEY --dry-run` "
        "shows one tenant's)",
        *(f"    {n.tag}{' (default: no cache_salt)' if n.default else ''}  {n.entries:,} live, "
          f"{format_bytes(n.live_bytes)}; {n.records:,} records in all, {format_bytes(n.record_bytes)}"
          for n in r.namespaces),
        "  age histogram (live entries)",
    ]
    for b in r.ages:
        span = f"{format_age(b.low_s)} .. {format_age(b.high_s)}" if b.high_s is not None else \
            f">= {format_age(b.low_s)} (expired)"
        lines.append(f"    {span:<24} {b.entries:>10,} entries  {format_bytes(b.bytes)}")
    return "\n".join(lines)


def format_verify(r: VerifyReport) -> str:
    verdict = "OK" if r.ok else f"{len(r.bad)} BAD"
    lines = [f"SSD tier {r.directory}: {r.records:,} records in {r.segments} segments checked "
             f"({format_bytes(r.bytes_checked)}): {verdict}"]
    for b in r.bad[:MAX_LISTED]:
        what = f"record {b.key}" if b.key else "damaged range"
        state = " (live: a future miss)" if b.live else ""
        lines.append(f"  segment {b.segment_id:012d} offset {b.offset}: {what}, {b.bytes} B: {b.reason}{state}")
    if len(r.bad) > MAX_LISTED:
        lines.append(f"  ... and {len(r.bad) - MAX_LISTED} more (--json lists them all)")
    for tag, (n, bad) in sorted(r.namespaces.items()):
        lines.append(f"  namespace {tag}: {n:,} records, {bad} bad")
    if r.legacy_records:
        lines.append(f"  {r.legacy_records:,} version-1 records (no tenant): never served, reclaimed as garbage")
    for t in r.torn:
        lines.append(f"  segment {t.segment_id:012d} offset {t.offset}: torn tail, {t.bytes} B (a crash mid-write; "
                     "ignored, not damage)")
    return "\n".join(lines)


def format_wipe(r: WipeResult, kv_dir: str, what: str, *, dry_run: bool) -> str:
    verb = "would remove" if dry_run else "removed"
    return (f"SSD tier {kv_dir}: {verb} {r.records_removed:,} records ({what}), {format_bytes(r.bytes_removed)}; "
            f"kept {r.records_kept:,}; segments deleted {r.segments_deleted}, rewritten {r.segments_rewritten}; "
            f"{format_bytes(r.bytes_freed)} freed"
            + (f"; {r.corrupt_dropped} corrupt records dropped" if r.corrupt_dropped else "")
            + (f"; {format_bytes(r.unattributed_removed)} of damaged, torn or version-1 bytes dropped"
               if r.unattributed_removed else ""))
