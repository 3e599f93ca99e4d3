"""SSDHealth: the SSD tier's fault states, each logged once when it changes and counted by cause.

A failing SSD tier costs cache misses, never a failed request; the log says so once per change and
the counters in ``SSDStats`` carry the rate. Three independent states::

    writes     ok ──append/fsync OSError──▶ failing(cause) ──a flush cycle without error──▶ ok
               cause: disk_full (ENOSPC, EDQUOT) | unwritable (EROFS, EACCES, EPERM) | io (the rest);
               a failure with another cause is a change too (disk full, then read-only: two lines)
    admission  admitting ──refused: the budget is full of young records──▶ refusing
               refusing ──a write fits, no refusal for ADMISSION_QUIET_S──▶ admitting  (hysteresis: a full
               tier admits a segment's worth of writes each time one expires; that is no state change)
    reads      ok ──pread OSError──▶ failing ──a read without error──▶ ok

Every change is one WARNING on the ``flashtier.kvstore.ssd`` logger (recoveries included, so an operator
who saw the first line sees the last). Every method needs the store's metadata lock (it writes the stats
it was given) and logs under it, which happens only on a change.
"""

from __future__ import annotations

import errno
import logging

from flashtier.kvstore.ssd.stats import SSDStats

log = logging.getLogger("flashtier.kvstore.ssd")

WRITE_CAUSES = ("disk_full", "unwritable", "io")  # label values of the write-error counters
_DISK_FULL = frozenset({errno.ENOSPC, errno.EDQUOT})
_UNWRITABLE = frozenset({errno.EROFS, errno.EACCES, errno.EPERM})
ADMISSION_QUIET_S = 60.0  # refusing -> admitting needs this long (store clock) without a refusal
_WHAT = {"disk_full": "disk full", "unwritable": "directory not writable", "io": "write I/O error"}


def write_cause(exc: OSError) -> str:
    """The counter label of a failed write: one of ``WRITE_CAUSES``."""
    if exc.errno in _DISK_FULL:
        return "disk_full"
    if exc.errno in _UNWRITABLE:
        return "unwritable"
    return "io"


class SSDHealth:
    """Write, admission and read states of one store; ``directory`` names it in the log lines."""

    def __init__(self, stats: SSDStats, directory: str) -> None:
        self._stats = stats
        self._dir = directory
        self.write_failing: str | None = None  # the cause of the current write fault; None when ok
        self.refusing = False
        self._last_refusal = 0.0  # store clock
        self.read_failing = False
        self._write_failures = 0  # failed writes since the write state last changed

    def write_failed_locked(self, exc: OSError, op: str) -> None:
        """Count one failed write (``op``: create, append, fsync, fsync-dir) by cause; log a change."""
        cause = write_cause(exc)
        st = self._stats
        st.write_errors += 1
        setattr(st, f"write_errors_{cause}", getattr(st, f"write_errors_{cause}") + 1)
        if self.write_failing == cause:
            self._write_failures += 1
            return
        self.write_failing, self._write_failures = cause, 1
        log.warning("SSD tier %s: %s (%s failed: %s); new blocks are not persisted (future cache misses) "
                    "until writes succeed again", self._dir, _WHAT[cause], op, exc)  # fmt: skip

    def write_ok_locked(self) -> None:
        """A flush cycle appended and fsynced without error: log the recovery if writes were failing."""
        if self.write_failing is not None:
            log.warning("SSD tier %s: writes recovered after %d failed writes (%s)", self._dir, self._write_failures,
                        _WHAT[self.write_failing])  # fmt: skip
            self.write_failing = None

    def refused_locked(self, budget_bytes: int, now: float) -> None:
        """Count one admission refusal (no I/O failed: young records fill the budget); log a change."""
        self._stats.admission_refusals += 1
        self._last_refusal = now
        if not self.refusing:
            self.refusing = True
            log.warning("SSD tier %s: the %d B budget is full of records inside their lifetime; new blocks "
                        "are refused (future cache misses) until some expire", self._dir, budget_bytes)  # fmt: skip

    def admitted_locked(self, now: float) -> None:
        """A write fitted the budget: log the change if writes were refused, but none for ADMISSION_QUIET_S
        (a saturated tier admits a segment's worth of writes whenever one expires: that is not a change)."""
        if self.refusing and now - self._last_refusal >= ADMISSION_QUIET_S:
            self.refusing = False
            log.warning("SSD tier %s: writes are admitted again (no refusal for %.0f s)", self._dir,
                        now - self._last_refusal)  # fmt: skip

    def read_failed_locked(self, n: int, exc: OSError | None) -> None:
        """Count ``n`` failed reads (their blocks are misses); log a change."""
        if n <= 0:
            return
        self._stats.read_errors += n
        if not self.read_failing:
            self.read_failing = True
            log.warning("SSD tier %s: read I/O error (%s); the blocks read are cache misses", self._dir, exc)

    def read_ok_locked(self) -> None:
        """Reads without error: log the recovery if reads were failing."""
        if self.read_failing:
            self.read_failing = False
            log.warning("SSD tier %s: reads recovered", self._dir)
