"""SSD tier restore speed: ``SSDStore.get_many`` against a plain sequential read of the same files.

Writes a store of ``--gb`` GB of block records (56,960 B payloads, the real model's block image), makes
it durable, then measures in this one run, with the page cache for the segment files evicted before
every cold row (fsync + ``posix_fadvise(DONTNEED)``, which needs no privileges; plus
``/proc/sys/vm/drop_caches`` when writable):

    raw_sequential         every segment file front to back, preadv into one reused 8 MiB buffer: the
                           ceiling (the disk plus the kernel's copy, no Python per record)
    get_many_written       get_many of every key in the order written, one call (returns bytes objects)
    get_many_shuffled      the same keys shuffled, one call
    get_many_turns         the keys in written order, calls of 1,563 keys (100K tokens: one agent turn),
                           each call's results dropped before the next (as the engine drops them)
    get_many_into_turns    get_many_into, the same calls, into one reused buffer (a pinned staging
                           buffer in the engine): no allocation, no copy in user space
    get_many_into_written  get_many_into of every key in one call, into one reused buffer
    *_hot                  the same with the files in the page cache: the CPU cost of the path
    crc32c_records         the checksum alone, in memory, over 57 KB records
    copy_records           bytes(view) of 57 KB records, in memory (the one copy get_many makes)

The cold rows run in ``--rounds`` rounds, each opened and closed by a raw read; a row's ratio is its
GB/s over the faster raw read of its own round (the disk and the CPUs of a shared machine drift), and
the table gives the median over rounds (GB/s also min and max), plus the process's CPU seconds per GB.
GB/s counts payload bytes delivered (file bytes for the raw read). Every payload served is compared
with the one written. ``--pipeline on|off`` forces the reader's I/O thread (default: the reader's own
choice, on with more than two CPUs).

How fast ``get_many`` can be depends on the allocator: its results are fresh bytes objects, and memory
the C allocator has just handed back to the kernel page-faults again on first touch (slow on a virtual
machine). ``MALLOC_TRIM_THRESHOLD_`` / ``GLIBC_TUNABLES`` are recorded in the output for that reason.

    .venv/bin/python benchmarks/tier_restore_bench.py --gb 2 --rounds 3 --out docs/perf/tier_restore.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import crc32c
import xxhash

from flashtier.kvstore.block_hash import BlockHash
from flashtier.kvstore.config import KVStoreConfig, ssd_segment_bytes_for
from flashtier.kvstore.ssd.record import HEADER_BYTES
from flashtier.kvstore.ssd.store import SSDStore

PAYLOAD = 56_960  # 890 B/token x 64 tokens
TURN_KEYS = 1_563  # 100K tokens of 64-token blocks
_POOL = os.urandom(8 << 20)  # payloads are windows of this, at key-derived offsets
_CHUNK = 8 << 20
T = TypeVar("T")


def key(i: int) -> BlockHash:
    return BlockHash(xxhash.xxh3_128_digest(i.to_bytes(8, "little")))


def payload(i: int, n: int = PAYLOAD) -> bytes:
    at = (i * 104_729) % (len(_POOL) - n)
    return _POOL[at : at + n]


def write_store(directory: Path, n: int) -> SSDStore:
    budget = 2 * n * (HEADER_BYTES + PAYLOAD) + (256 << 20)
    segment = ssd_segment_bytes_for(budget)
    store = SSDStore(KVStoreConfig(ssd_dir=str(directory), ssd_budget_bytes=budget, ssd_segment_bytes=segment))
    for i in range(n):
        if not store.put(key(i), payload(i)).ok:
            raise RuntimeError(f"put {i} failed: {store.stats()}")
    if not store.flush():
        raise RuntimeError("flush failed")
    return store


def segment_files(directory: Path) -> list[Path]:
    return sorted(p for p in directory.iterdir() if p.suffix == ".seg")


def evict(files: list[Path]) -> str:
    """Drop the files' pages from the page cache; returns how ("fadvise" or "fadvise+drop_caches")."""
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1\n")
        return "fadvise+drop_caches"
    except OSError:
        return "fadvise"


@dataclass
class Spent:
    """Bytes delivered, wall seconds and this process's CPU seconds (user + system) of one measurement."""

    nbytes: int = 0
    wall: float = 0.0
    cpu: float = 0.0

    def time(self, fn: Callable[[], T]) -> T:
        w, c = time.perf_counter(), time.process_time()
        out = fn()
        self.wall += time.perf_counter() - w
        self.cpu += time.process_time() - c
        return out

    @property
    def rate(self) -> float:
        return self.nbytes / self.wall


def raw_sequential(files: list[Path]) -> Spent:
    buf, spent = bytearray(_CHUNK), Spent()

    def read_all() -> int:
        total = 0
        for path in files:
            fd = os.open(path, os.O_RDONLY)
            try:
                off = 0
                while n := os.preadv(fd, [buf], off):
                    off += n
                total += off
            finally:
                os.close(fd)
        return total

    spent.nbytes = spent.time(read_all)
    return spent


def timed_get(store: SSDStore, idx: list[int], batch: int) -> Spent:
    """get_many over ``idx`` in calls of ``batch``, each call's results dropped before the next; checks
    every payload (outside the timing)."""
    spent = Spent()
    for s in range(0, len(idx), batch):
        part = idx[s : s + batch]
        keys = [key(i) for i in part]
        got = spent.time(lambda: store.get_many(keys))
        for i, p in zip(part, got, strict=True):
            if p != payload(i):
                raise RuntimeError(f"record {i}: {'miss' if p is None else 'wrong bytes'}")
            spent.nbytes += len(p)
        del got
    return spent


def timed_get_into(store: SSDStore, idx: list[int], batch: int, dest: bytearray) -> Spent:
    """timed_get for get_many_into, every call reusing ``dest`` (as the engine reuses a pinned buffer)."""
    spent = Spent()
    for s in range(0, len(idx), batch):
        part = idx[s : s + batch]
        keys = [key(i) for i in part]
        ok = spent.time(lambda: store.get_many_into(keys, dest, PAYLOAD))
        for j, (i, hit) in enumerate(zip(part, ok, strict=True)):
            if not hit or dest[j * PAYLOAD : (j + 1) * PAYLOAD] != payload(i):  # (a memoryview compares slowly)
                raise RuntimeError(f"record {i}: {'wrong bytes' if hit else 'miss'}")
            spent.nbytes += PAYLOAD
    return spent


def in_memory_rows(record_count: int) -> list[dict]:
    buf = (_POOL * 8)[: 64 << 20]
    view, n = memoryview(buf), min(record_count, len(buf) // PAYLOAD)
    rows = []
    for name, fn in (("crc32c_records", crc32c.crc32c), ("copy_records", bytes)):
        spent = Spent(nbytes=4 * n * PAYLOAD)
        spent.time(lambda: [fn(view[i * PAYLOAD : (i + 1) * PAYLOAD]) for _ in range(4) for i in range(n)])
        rows.append(row(name, [spent], None))
    return rows


def row(name: str, runs: list[Spent], ceilings: list[float] | None) -> dict:
    """A table row: medians over ``runs`` (GB/s also min and max); ratios against each run's own ceiling."""
    rates = [r.rate / 1e9 for r in runs]
    out = {"name": name, "bytes": runs[0].nbytes, "gb_s": round(statistics.median(rates), 3),
           "gb_s_min": round(min(rates), 3), "gb_s_max": round(max(rates), 3),
           "cpu_s_per_gb": round(statistics.median(r.cpu / r.nbytes * 1e9 for r in runs), 3)}  # fmt: skip
    if ceilings is not None:
        out["ratio_vs_raw"] = round(statistics.median(r.rate / c for r, c in zip(runs, ceilings)), 3)
    return out


def cold_rounds(files: list[Path], cold: dict[str, Callable[[], Spent]], rounds: int) -> tuple[list[dict], float, str]:
    """Each round: raw read, every cold row, raw read (evicting before each). Returns the rows, the median
    ceiling (GB/s of the faster raw read of each round) and how the cache was evicted."""
    how = evict(files)
    raw_sequential(files)  # untimed: the first pass over fresh page-cache memory is slower for every reader
    seen: dict[str, list[Spent]] = {name: [] for name in ("raw_sequential", *cold)}
    ceilings = []
    for _ in range(rounds):
        got: dict[str, Spent] = {}
        for name, run in (("raw_sequential", lambda: raw_sequential(files)), *cold.items(),
                          ("raw_again", lambda: raw_sequential(files))):  # fmt: skip
            how = evict(files)
            got[name] = run()
        faster = max(got.pop("raw_again"), got["raw_sequential"], key=lambda sp: sp.rate)
        got["raw_sequential"] = faster
        ceilings.append(faster.rate)
        for name in seen:
            seen[name].append(got[name])
    return [row(name, runs, ceilings) for name, runs in seen.items()], statistics.median(ceilings), how


def device() -> str:
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")),
               platform.processor() or platform.machine())  # fmt: skip
    return f"CPU ({cpu}), {os.cpu_count()} cores; Python {platform.python_version()}, {platform.system()}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gb", type=float, default=2.0, help="store size in GB of records")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of cold rows (medians are reported)")
    ap.add_argument("--dir", default=None, help="parent directory of the store (default: the system temp dir)")
    ap.add_argument("--out", default=None, help="write the JSON result here")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--pipeline", choices=("auto", "on", "off"), default="auto",
                    help="read on an I/O thread while checking (auto: the reader's default, on with > 2 CPUs)")
    args = ap.parse_args()
    n = int(args.gb * 1e9) // (HEADER_BYTES + PAYLOAD)
    load_before = os.getloadavg()
    root = Path(tempfile.mkdtemp(prefix="tier_restore_", dir=args.dir))
    try:
        t0 = time.perf_counter()
        store = write_store(root / "ssd", n)
        write_s = time.perf_counter() - t0
        files = segment_files(root / "ssd")
        if args.pipeline != "auto":  # the store builds its reader with the default; swap in the one asked for
            from flashtier.kvstore.ssd.reader import SSDReader

            old = store._reader
            store._reader = SSDReader(old._meta, old._refresh, old._clock, coalesce_gap_bytes=old._gap,
                                      pipeline=args.pipeline == "on")  # fmt: skip
        pipelined = getattr(store._reader, "pipelined", None)  # None: a reader without the I/O thread
        written, shuffled = list(range(n)), list(range(n))
        random.Random(args.seed).shuffle(shuffled)
        cold: dict[str, Callable[[], Spent]] = {"get_many_written": lambda: timed_get(store, written, n),
                                    "get_many_shuffled": lambda: timed_get(store, shuffled, n),
                                    "get_many_turns": lambda: timed_get(store, written, TURN_KEYS)}  # fmt: skip
        hot: dict[str, Callable[[], Spent]] = {"get_many_hot": lambda: timed_get(store, written, n),
                                   "get_many_turns_hot": lambda: timed_get(store, written, TURN_KEYS)}  # fmt: skip
        if hasattr(store, "get_many_into"):  # absent before the coalesced reader: rows skipped
            turn_buf, all_buf = bytearray(TURN_KEYS * PAYLOAD), bytearray(n * PAYLOAD)  # faulted in once, here
            cold["get_many_into_turns"] = lambda: timed_get_into(store, written, TURN_KEYS, turn_buf)
            cold["get_many_into_written"] = lambda: timed_get_into(store, written, n, all_buf)
            hot["get_many_into_turns_hot"] = lambda: timed_get_into(store, written, TURN_KEYS, turn_buf)
        rows, ceiling, how = cold_rounds(files, cold, args.rounds)
        timed_get(store, written, TURN_KEYS)  # warm the page cache (the files fit in memory)
        rows += [row(name, [run()], [ceiling]) for name, run in hot.items()]
        rows += in_memory_rows(n)
        st = store.stats()
        store.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    env = {k: v for k, v in os.environ.items() if k in ("MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "GLIBC_TUNABLES")}
    load = [round(load_before[0], 2), round(os.getloadavg()[0], 2)]
    result = {"device": device(), "command": "benchmarks/tier_restore_bench.py " + " ".join(sys.argv[1:]),
              "allocator_env": env, "pipelined": pipelined, "load_average_before_after": load, "records": n,
              "payload_bytes": PAYLOAD, "segment_files": len(files), "write_s": round(write_s, 2), "eviction": how,
              "rounds": args.rounds, "read_ops": st.read_ops, "ceiling_gb_s": round(ceiling / 1e9, 3),
              "ceiling": "median over rounds of the faster raw_sequential read of each round",
              "rows": rows}  # fmt: skip
    print(f"{n} records of {PAYLOAD} B in {len(files)} segments ({how}); ceiling {ceiling / 1e9:.3f} GB/s; "
          f"load {load}; allocator env {env or 'default'}; I/O thread {pipelined}")
    print(f"{'row':<24}{'GB/s':>8}{'min':>8}{'max':>8}{'x raw':>8}{'cpu s/GB':>10}")
    for r in rows:
        ratio = r.get("ratio_vs_raw")
        print(f"{r['name']:<24}{r['gb_s']:>8.3f}{r['gb_s_min']:>8.3f}{r['gb_s_max']:>8.3f}"
              f"{'-' if ratio is None else f'{ratio:.3f}':>8}{r['cpu_s_per_gb']:>10.3f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
            f.write("\n")


if __name__ == "__main__":
    main()
