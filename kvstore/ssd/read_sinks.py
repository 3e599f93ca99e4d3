"""Where a run's bytes go: ``BytesSink`` (get_many: one bytes per payload) or ``IntoSink`` (get_many_into:
payloads scattered straight into the caller's buffer), plus the ``ReadTally`` both count into.

Each run is handled in two steps, so the reader can overlap them (the next run's ``fill`` on an I/O
thread while this run's ``check`` runs)::

    BytesSink  fill: disk ──preadv──▶ run buffer k % 2       check: verify views ──▶ payload.tobytes()
    IntoSink   fill: disk ──preadv──▶ headers to scratch,    check: verify in place (no copy in user
                                      payloads to the slots         space at all)

``check`` serves a record only when ``record_intact`` accepts it and the read reached its end. Any other
record is a miss: ``None`` in ``out``, or ``False`` with its slot zero-filled, so unverified bytes are
never left for the caller.

Not thread-safe in general: one sink belongs to one get_many call. The reader may run ``fill`` of run k+1
on one thread while ``check`` of run k runs on another: they touch different buffers (BytesSink
alternates two; IntoSink writes each run's own slots), and only ``check`` writes the outputs and the tally.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from flashtier.kvstore.block_hash import BlockHash
from flashtier.kvstore.ssd.index import IndexEntry
from flashtier.kvstore.ssd.read_check import record_intact
from flashtier.kvstore.ssd.read_io import preadv_full
from flashtier.kvstore.ssd.read_plan import Located, ReadRun
from flashtier.kvstore.ssd.record import HEADER_BYTES


@dataclass(slots=True)
class ReadTally:
    """What one read saw, counted into the store's stats at its end."""

    served: dict[BlockHash, IndexEntry] = field(default_factory=dict)  # verified hits
    bad: list[Located] = field(default_factory=list)  # records failing checks
    nbytes: int = 0
    nops: int = 0
    errors: int = 0
    error: OSError | None = None  # the first one, for the log line of a state change

    def failed(self, exc: OSError) -> None:
        self.errors, self.error = self.errors + 1, self.error or exc


@dataclass(slots=True)
class _Scattered:
    """What IntoSink.fill read for one run: the headers, each record's slot and its caller positions."""

    heads: bytearray
    slots: list[memoryview]
    where: list[list[int]]
    got: int


class BytesSink:
    """get_many's output: ``out[i]`` is the verified payload of ``keys[i]`` as bytes, or None."""

    def __init__(self, positions: dict[BlockHash, list[int]], n: int, bufs: list[bytearray]) -> None:
        """``positions``: key -> indexes in the caller's list; ``bufs``: two run buffers, used in turn
        (a run longer than them gets a buffer of its own)."""
        self.out: list[bytes | None] = [None] * n
        self._positions = positions
        self._bufs = bufs

    def accepts(self, entry: IndexEntry) -> bool:
        return True

    def hits(self) -> int:
        return sum(p is not None for p in self.out)

    def fill(self, fd: int, run: ReadRun, k: int) -> tuple[memoryview, int]:
        """Read run number ``k`` into buffer ``k % 2``. Failure: OSError (nothing of the run is served)."""
        buf = self._bufs[k % len(self._bufs)]
        view = memoryview(buf if run.length <= len(buf) else bytearray(run.length))[: run.length]
        return view, preadv_full(fd, [view], run.offset)

    def check(self, run: ReadRun, filled: tuple[memoryview, int], tally: ReadTally) -> None:
        """Verify the records of a filled run and set ``out`` for them. Mutates ``out`` and ``tally``."""
        view, got = filled
        tally.nbytes, tally.nops = tally.nbytes + got, tally.nops + 1
        for key, entry in run.records:
            at = entry.offset - run.offset
            end = at + HEADER_BYTES + entry.length
            payload = view[at + HEADER_BYTES : end]
            data = None
            if end <= got and record_intact(view, at, payload, key.digest, entry.length):
                data, tally.served[key] = payload.tobytes(), entry
            else:
                tally.bad.append((key, entry))
            for i in self._positions[key]:
                self.out[i] = data


class IntoSink:
    """get_many_into's output: payload of ``keys[i]`` in ``dest[i * slot : (i + 1) * slot]`` and ``ok[i]``."""

    def __init__(self, positions: dict[BlockHash, list[int]], n: int, dest: memoryview, slot: int) -> None:
        """``dest``: a writable byte view of at least ``n * slot`` bytes (the caller validated it)."""
        self.ok = [False] * n
        self._positions = positions
        self._dest = dest
        self._slot = slot
        self._holes = bytearray(0)  # bytes between records of a run are read here and dropped

    def accepts(self, entry: IndexEntry) -> bool:
        """Only records that fill a slot exactly; another length is a plain miss (not damage)."""
        return entry.length == self._slot

    def hits(self) -> int:
        return sum(self.ok)

    def fill(self, fd: int, run: ReadRun, k: int) -> _Scattered:
        """Scatter ``run`` into the slots of its keys' first positions (headers into scratch). Mutates
        those slots. Failure: OSError from the read, after zero-filling the slots."""
        size, dest = self._slot, self._dest
        out = _Scattered(bytearray(HEADER_BYTES * len(run.records)), [], [], 0)
        hv, views, cursor = memoryview(out.heads), [], run.offset
        for j, (key, entry) in enumerate(run.records):
            if entry.offset > cursor:
                if len(self._holes) < entry.offset - cursor:
                    self._holes = bytearray(entry.offset - cursor)
                views.append(memoryview(self._holes)[: entry.offset - cursor])
            out.where.append(self._positions[key])
            i = out.where[-1][0] * size
            out.slots.append(dest[i : i + size])
            views += (hv[j * HEADER_BYTES : (j + 1) * HEADER_BYTES], out.slots[-1])
            cursor = entry.offset + HEADER_BYTES + entry.length
        try:
            out.got = preadv_full(fd, views, run.offset)
        except OSError:
            for slot in out.slots:
                slot[:] = bytes(size)
            raise
        return out

    def check(self, run: ReadRun, filled: _Scattered, tally: ReadTally) -> None:
        """Verify a filled run in place: a hit sets ``ok`` (and copies the slot to the key's other
        positions), anything else zero-fills the slot. Mutates ``dest``, ``ok`` and ``tally``."""
        size, dest, ok = self._slot, self._dest, self.ok
        tally.nbytes, tally.nops = tally.nbytes + filled.got, tally.nops + 1
        limit = run.offset + filled.got
        for j, ((key, entry), slot, at) in enumerate(zip(run.records, filled.slots, filled.where)):
            if entry.offset + HEADER_BYTES + entry.length <= limit and record_intact(
                    filled.heads, j * HEADER_BYTES, slot, key.digest, entry.length):  # fmt: skip
                tally.served[key] = entry
                ok[at[0]] = True
                for i in at[1:]:  # the same key listed again: a copy of the verified slot
                    dest[i * size : (i + 1) * size] = slot
                    ok[i] = True
            else:
                slot[:] = bytes(size)
                tally.bad.append((key, entry))
