"""KVStoreConfig: the one (frozen) configuration object of flashtier.kvstore.

Built once by server/config/settings.py from CLI flags / ``FLASHTIER_*`` variables and validated here, with
ValueError messages that name the field; kvstore never reads the environment itself. Sizes are bytes,
durations seconds.

HBM pool size, first match wins::

    num_blocks          set  ->  exactly that many block ids (block 0 is the reserved null block)
    hbm_budget_bytes    set  ->  budget // block_bytes
    neither             ->  hbm_utilization x device bytes available for KV (measured by the engine)
"""

from __future__ import annotations

from dataclasses import dataclass

GiB = 1 << 30
MiB = 1 << 20
MAX_SSD_SEGMENT_BYTES = 256 * MiB  # the default segment; small budgets get smaller ones (ssd_segment_bytes_for)
MIN_SSD_SEGMENT_BYTES = 1 * MiB
MIN_SSD_BUDGET_BYTES = MIN_SSD_SEGMENT_BYTES  # a budget must hold one segment
SSD_SEGMENTS_PER_BUDGET = 8  # a small budget is cut into about this many segments


def ssd_segment_bytes_for(budget_bytes: int) -> int:
    """The segment size for an SSD budget: budget / 8, within [1 MiB, 256 MiB] (and never above the budget).

    Small budgets get small segments, so compaction still has several segments to work with.
    """
    share = max(MIN_SSD_SEGMENT_BYTES, budget_bytes // SSD_SEGMENTS_PER_BUDGET)
    return min(MAX_SSD_SEGMENT_BYTES, budget_bytes, share)


def ssd_budget_bytes_for(record_bytes: int) -> int:
    """The smallest budget whose segments (``ssd_segment_bytes_for``) hold a record of ``record_bytes``."""
    if record_bytes <= MIN_SSD_SEGMENT_BYTES:
        return MIN_SSD_BUDGET_BYTES
    return record_bytes * SSD_SEGMENTS_PER_BUDGET


def _positive(name: str, value: float) -> None:
    if not value > 0:
        raise ValueError(f"KVStoreConfig.{name} must be > 0, got {value!r}")


@dataclass(frozen=True)
class KVStoreConfig:
    """Everything kvstore needs to know that is not the model geometry (that is ``KVGeometry``)."""

    # HBM runtime pool
    block_size: int = 64  # tokens per block; a multiple of 8 (every compression ratio divides it)
    num_blocks: int | None = None  # explicit pool size in block ids, null block included
    hbm_budget_bytes: int | None = None  # or: bytes of HBM for global-KV blocks
    hbm_utilization: float = 0.9  # or: fraction of the KV-available device bytes, in (0, 1]
    enable_prefix_caching: bool = True  # keep freed full blocks hashed (LRU prefix cache)
    # SSD tier (global KV, write-through, log-structured segments)
    ssd_dir: str | None = None  # None disables the SSD tier
    ssd_budget_bytes: int = 512 * GiB  # disk budget; full of young records => admission refusals
    ssd_segment_bytes: int = MAX_SSD_SEGMENT_BYTES  # one append-only segment file (ssd_segment_bytes_for)
    ssd_lifetime_s: float = 72 * 3600.0  # guaranteed lifetime from the last write
    ssd_refresh_age_s: float = 24 * 3600.0  # a hit on an older record re-appends it
    # snapshot pool (encoder SWA rings + tail), Redis or the embedded in-process pool
    redis_url: str | None = None  # None: the embedded pool with the same interface
    snapshot_ttl_s: float = 300.0  # TTL of every snapshot key (SET ... PX)
    snapshot_budget_bytes: int = 4 * GiB  # byte budget of the embedded pool
    redis_timeout_s: float = 0.25  # a slower Redis answer counts as a miss

    def __post_init__(self) -> None:
        bs = self.block_size
        if isinstance(bs, bool) or not isinstance(bs, int) or bs <= 0 or bs % 8:
            raise ValueError(f"KVStoreConfig.block_size must be a positive multiple of 8 (e.g. 64), got {bs!r}")
        if self.num_blocks is not None and self.hbm_budget_bytes is not None:
            raise ValueError("set only one of KVStoreConfig.num_blocks and KVStoreConfig.hbm_budget_bytes")
        if self.num_blocks is not None and self.num_blocks < 2:
            raise ValueError(
                f"KVStoreConfig.num_blocks must be >= 2 (block 0 is the reserved null block), got {self.num_blocks}"
            )
        if self.hbm_budget_bytes is not None:
            _positive("hbm_budget_bytes", self.hbm_budget_bytes)
        if not 0 < self.hbm_utilization <= 1:
            raise ValueError(f"KVStoreConfig.hbm_utilization must be in (0, 1], got {self.hbm_utilization!r}")
        for name in ("ssd_budget_bytes", "ssd_segment_bytes", "ssd_lifetime_s", "ssd_refresh_age_s",
                     "snapshot_ttl_s", "snapshot_budget_bytes", "redis_timeout_s"):  # fmt: skip
            _positive(name, getattr(self, name))
        if self.ssd_segment_bytes > self.ssd_budget_bytes:
            raise ValueError(
                f"KVStoreConfig.ssd_segment_bytes ({self.ssd_segment_bytes}) exceeds ssd_budget_bytes "
                f"({self.ssd_budget_bytes}): a segment must fit the budget (ssd_segment_bytes_for(budget) gives one "
                f"that does; the smallest budget is {MIN_SSD_BUDGET_BYTES} B)"
            )
        if self.ssd_refresh_age_s >= self.ssd_lifetime_s:
            raise ValueError(
                f"KVStoreConfig.ssd_refresh_age_s ({self.ssd_refresh_age_s}) must be below ssd_lifetime_s "
                f"({self.ssd_lifetime_s}), or hot prefixes could expire before they are refreshed"
            )
        if self.ssd_dir == "":
            raise ValueError("KVStoreConfig.ssd_dir is empty; pass a directory or None to disable the SSD tier")

    @property
    def ssd_enabled(self) -> bool:
        return self.ssd_dir is not None

    def pool_blocks(self, block_bytes: int, available_bytes: int | None = None) -> int:
        """Number of HBM block ids (null block included) for blocks of ``block_bytes`` bytes.

        ``available_bytes`` (device bytes the engine can give to KV) is needed only when neither
        ``num_blocks`` nor ``hbm_budget_bytes`` is set. ValueError when the result leaves no usable block.
        """
        _positive("pool_blocks(block_bytes)", block_bytes)
        if self.num_blocks is not None:
            return self.num_blocks
        if self.hbm_budget_bytes is not None:
            budget, source = self.hbm_budget_bytes, f"hbm_budget_bytes={self.hbm_budget_bytes}"
        elif available_bytes is None:
            raise ValueError("KVStoreConfig sets neither num_blocks nor hbm_budget_bytes; pass available_bytes")
        else:
            budget = int(available_bytes * self.hbm_utilization)
            source = f"hbm_utilization={self.hbm_utilization} x {available_bytes} available bytes"
        n = budget // block_bytes
        if n < 2:
            raise ValueError(f"{source} holds {n} block(s) of {block_bytes} B; the pool needs at least 2")
        return n
