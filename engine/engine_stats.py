"""The tier counters and gauges as one flat mapping for ``EngineStats.tiers`` (the server's /metrics), and
the speculative-decoding fields of ``EngineStats`` (``spec_fields``, from engine/spec/stats.py and the goodput
controller, engine/spec/controller.py).

A key is a metric name without the ``flashtier_`` prefix; a labelled sample is spelled
``name{label=value}`` (``tier_key``, parsed back by ``split_tier_key``), and server/serving/metrics.py exports
every key of one name as one family. Gauges are listed in server/serving/metrics.py's ``TIER_GAUGES``; every
other key is a counter (exported with ``_total``). Faults are counted by cause:

    ssd_write_errors{cause=disk_full|unwritable|io}   appends/fsyncs that failed (blocks not persisted)
    ssd_admission_refusals                            writes refused: the budget is full of young records
    ssd_writer_dropped                                writes dropped: the write-behind queue was full
    ssd_read_errors                                   preads that failed (the blocks were misses)
    ssd_budget_bytes, ssd_lifetime_s                  gauges: the SSD budget and guaranteed lifetime in force
    snapshot_redis_calls, snapshot_redis_call_s       Redis round trips and their summed seconds (mean latency)
    snapshot_redis_op_errors{op=...}, snapshot_redis_op_timeouts{op=...}, snapshot_redis_skipped{op=...}
                                                      Redis calls failed / timed out / skipped (breaker open)
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from flashtier.kvstore.ssd.health import WRITE_CAUSES

if TYPE_CHECKING:  # annotations only: the API process imports this module and needs neither the model nor tiers
    from flashtier.engine.spec.controller import SpecController
    from flashtier.engine.spec.stats import SpecStats
    from flashtier.engine.tiers.manager import TierManager

_SSD = ("bytes", "entries", "segments", "oldest_entry_age_s", "admission_refusals", "expirations",
        "corrupt_records", "bytes_read", "bytes_written", "hits", "misses", "read_errors", "torn_bytes",
        "compactions", "refreshes")  # fmt: skip
_SNAPSHOT = ("hits", "misses", "errors", "corrupt", "bytes_written", "bytes_read", "redis_errors", "timeouts",
             "put_failures")  # fmt: skip
_BY_OP = (("errors_by_op", "redis_op_errors"), ("timeouts_by_op", "redis_op_timeouts"),
          ("skipped_by_op", "redis_skipped"))  # fmt: skip
_KEY = re.compile(r"^([A-Za-z0-9_]+)(?:\{([^{}]*)\})?$")


def tier_key(name: str, **labels: str) -> str:
    """``name`` or ``name{a=x,b=y}``: the flat key of one (labelled) sample."""
    if not labels:
        return name
    return name + "{" + ",".join(f"{k}={v}" for k, v in labels.items()) + "}"


def split_tier_key(key: str) -> tuple[str, tuple[tuple[str, str], ...]]:
    """Inverse of ``tier_key``: (name, ((label, value), ...)). A key of another shape is a bare name."""
    m = _KEY.match(key)
    if m is None or not m.group(2):
        return key, ()
    pairs = tuple(tuple(part.split("=", 1)) for part in m.group(2).split(","))
    if any(len(p) != 2 or not p[0] for p in pairs):
        return key, ()
    return m.group(1), pairs  # type: ignore[return-value]


def tier_stats(tiers: TierManager | None) -> dict[str, float]:
    """Reads counters without a lock (a slightly stale snapshot is fine for metrics)."""
    if tiers is None:
        return {}
    t = tiers.stats
    out: dict[str, float] = {
        "ssd_blocks_written": t.ssd_blocks_written, "ssd_bytes_written": t.ssd_bytes_written,
        "ssd_write_refused": t.ssd_write_refused, "ssd_blocks_loaded": t.ssd_blocks_loaded,
        "snapshot_puts": t.snapshot_puts, "snapshot_bytes_written": t.snapshot_bytes_written,
        "snapshot_restored": t.snapshot_restored, "snapshot_restore_corrupt": t.snapshot_restore_corrupt,
    }  # fmt: skip
    for outcome, n in t.snapshot_lookups.items():
        out[f"snapshot_lookup_{outcome.value}"] = n
    if tiers.ssd is not None:
        s = tiers.ssd.stats()
        for name in _SSD:
            out[f"ssd_{name}"] = getattr(s, name)
        for cause in WRITE_CAUSES:
            out[tier_key("ssd_write_errors", cause=cause)] = getattr(s, f"write_errors_{cause}")
        # the settings the gauges above are judged against (dashboards, alert rules)
        out["ssd_budget_bytes"] = tiers.config.ssd_budget_bytes
        out["ssd_lifetime_s"] = tiers.config.ssd_lifetime_s
    if tiers.writer is not None:
        out["ssd_writer_dropped"] = tiers.writer.stats().dropped
    ps = tiers.snapshots.stats()
    for name in _SNAPSHOT:
        out[f"snapshot_{name}"] = getattr(ps, name)
    if ps.errors_by_op:  # the Redis pool (the embedded pool makes no calls that could fail)
        for field, name in _BY_OP:
            for op, n in getattr(ps, field).items():
                out[tier_key(f"snapshot_{name}", op=op)] = n
        out["snapshot_redis_breaker_opens"] = ps.breaker_opens
        out["snapshot_redis_down"] = ps.redis_down
        out["snapshot_redis_calls"] = ps.redis_calls
        out["snapshot_redis_call_s"] = ps.redis_call_s
    return out


def spec_fields(stats: SpecStats | None, control: SpecController | None = None) -> dict[str, object]:
    """The speculative-decoding fields of ``EngineStats`` (none when speculation is off)."""
    if stats is None:
        return {}
    out: dict[str, object] = {
        "spec_drafts": stats.drafts, "spec_draft_tokens": stats.draft_tokens,
        "spec_accepted_tokens": stats.accepted_tokens, "spec_acceptance_lengths": tuple(stats.acceptance),
        "spec_accepted_by_position": tuple(stats.accepted_by_position),
    }  # fmt: skip
    if control is not None:
        out["spec_draft_length"] = control.draft_length
        out["spec_steps_by_draft_length"] = tuple(control.steps_by_length)
    return out
