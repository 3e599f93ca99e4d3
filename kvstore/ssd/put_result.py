"""PutResult: the outcome of one SSD write, returned by ``SSDStore.put`` and SSDWriter's futures.

Every outcome is a value, never an exception: a refused, failed or dropped block is a future miss and
serving goes on.
"""

from __future__ import annotations

from enum import Enum


class PutResult(Enum):
    """Outcome of one write; only STORED means the record is (or, after flush, will be) on disk."""

    STORED = "stored"
    REFUSED = "refused"  # admission control: the budget is full of records inside their lifetime
    FAILED = "failed"  # an I/O error (counted in write_errors)
    DROPPED = "dropped"  # SSDWriter only: its queue was over its byte bound

    @property
    def ok(self) -> bool:
        return self is PutResult.STORED
