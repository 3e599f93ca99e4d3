"""A contiguous slice of one axis held by one rank, and the even split that hands them out."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Shard:
    start: int
    size: int

    @property
    def stop(self) -> int:
        return self.start + self.size

    @property
    def slice(self) -> slice:
        return slice(self.start, self.stop)


def even_shard(n: int, parts: int, index: int) -> Shard:
    """Part ``index`` of ``n`` items cut into ``parts`` contiguous runs; the first ``n % parts`` runs get one
    more (so a run may be empty when n < parts). Raises ValueError on a bad part count or index."""
    if parts < 1 or not 0 <= index < parts:
        raise ValueError(f"index {index} must lie in [0, parts={parts})")
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    base, extra = divmod(n, parts)
    return Shard(index * base + min(index, extra), base + (index < extra))
