"""Helper process for test_ssd_crash.py: SSD writers that the test SIGKILLs at random moments.

Run as a script it is a *launcher*: it imports the store once, then serves one line per trial on stdin::

    run <ssd_dir> <seed> <keys_file>   ->  prints "pid <pid>", forks a writer, waits for it,
                                           then prints "exit <code>" (-9 after a SIGKILL)

Forking from this single-threaded launcher makes a trial start in milliseconds however heavy the
package imports become. The writer opens an SSDStore on ``ssd_dir`` (rebuilding its index from whatever
the previous, killed writer left), starts an SSDWriter and writes forever: new random keys and rewrites
of keys already on disk (so records die and segments get compacted or deleted while it runs), with
reads in between (hits on old records queue refreshes, which maintain() re-appends). It
appends a key's hex to ``keys_file`` only after its future resolved STORED, i.e. after the fsync that
covered it returned; the test then checks every listed key is readable with exactly ``payload_for(key)``.
It creates ``<keys_file>.ready`` once its store is open (the start-up scan fsyncs every segment, which
takes a while on some disks), so the test can aim most kills at the writing phase.
"""

from __future__ import annotations

import os
import random
import sys
import time

import xxhash

from flashtier.kvstore.block_hash import BlockHash
from flashtier.kvstore.config import KVStoreConfig
from flashtier.kvstore.ssd.store import PutResult, SSDStore
from flashtier.kvstore.ssd.writer import SSDWriter

SEGMENT_BYTES = 4096
BUDGET_BYTES = 48 * 1024  # 12 segments: eviction starts within a few trials of each directory
LIFETIME_S = 1.5  # real seconds: records from earlier trials expire, so eviction runs during the kills
REFRESH_AGE_S = 0.5
MAX_RUN_S = 5.0  # a writer nobody kills exits on its own (no orphans if the test dies)


def crash_config(ssd_dir: str) -> KVStoreConfig:
    return KVStoreConfig(ssd_dir=ssd_dir, ssd_budget_bytes=BUDGET_BYTES, ssd_segment_bytes=SEGMENT_BYTES,
                         ssd_lifetime_s=LIFETIME_S, ssd_refresh_age_s=REFRESH_AGE_S)  # fmt: skip


def payload_for(key: BlockHash) -> bytes:
    """Self-checking payload: its size (8..518 B) and bytes are functions of the key alone."""
    n = 8 + 2 * key.digest[0]
    stream = b"".join(xxhash.xxh3_128_digest(key.digest + i.to_bytes(4, "little")) for i in range(n // 16 + 1))
    return stream[:n]


def write_forever(ssd_dir: str, seed: int, keys_file: str) -> None:
    rng = random.Random(seed)
    out = os.open(keys_file, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    store = SSDStore(crash_config(ssd_dir))
    old = store.keys()
    writer = SSDWriter(store, max_batch_records=rng.choice([1, 4, 16, 64]), maintain_interval_s=0.002)
    os.close(os.open(keys_file + ".ready", os.O_WRONLY | os.O_CREAT, 0o644))  # start-up (scan, fsyncs) is over
    deadline = time.monotonic() + MAX_RUN_S
    written: list[BlockHash] = []
    inflight = []
    while time.monotonic() < deadline:
        pool = old if rng.random() < 0.5 else written
        key = rng.choice(pool) if pool and rng.random() < 0.4 else BlockHash(rng.randbytes(16))
        inflight.append((key, writer.submit(key, payload_for(key))))
        if old and rng.random() < 0.05:
            sample = rng.sample(old, min(8, len(old)))
            for k, got in zip(sample, store.get_many(sample)):
                assert got is None or got == payload_for(k), k
        if len(inflight) >= 8:
            key, future = inflight.pop(0)
            if future.result() is PutResult.STORED:
                os.write(out, key.hex().encode() + b"\n")
                written.append(key)
    os._exit(3)


def main() -> None:
    for line in sys.stdin:
        cmd, ssd_dir, seed, keys_file = line.split()
        assert cmd == "run", line
        pid = os.fork()
        if pid == 0:
            try:
                write_forever(ssd_dir, int(seed), keys_file)
            finally:
                os._exit(4)
        print(f"pid {pid}", flush=True)
        _, status = os.waitpid(pid, 0)
        print(f"exit {os.waitstatus_to_exitcode(status)}", flush=True)


if __name__ == "__main__":
    main()
