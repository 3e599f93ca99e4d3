"""Crash safety of the SSD tier: writers SIGKILLed at random moments (50 trials).

Each trial forks a writer (tests/kvstore/ssd_crash_writer.py) on one of five directories, kills it
after a random 0-150 ms (counted from the fork in one trial of four, so during start-up, and from the
end of the writer's start-up in the others: appends, fsyncs, segment rolls, refreshes, compaction or
eviction), then opens a store on the directory and checks:
- ``check_integrity(deep=True)`` holds;
- every key acknowledged (listed after its fsync returned) and still inside its lifetime reads back
  with its exact payload. Lifetimes are 1.5 real seconds here, so records of earlier trials expire and
  may be evicted by later writers: a key may be missing only if its acknowledging trial started more
  than a lifetime ago (its created_at is no earlier than that start);
- everything else the index serves is the right payload, and no record is corrupt (a kill only ever
  tears the tail of the segment being written; torn tails themselves are tested by truncation in
  test_ssd_store.py).
"""

import importlib.util
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

from flashtier.kvstore.block_hash import BlockHash
from flashtier.kvstore.ssd.store import SSDStore

HELPER = Path(__file__).with_name("ssd_crash_writer.py")
_spec = importlib.util.spec_from_file_location("ssd_crash_writer", HELPER)
crash = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(crash)

TRIALS = 50
DIRS = 5  # trials accumulate state per directory: later trials rebuild over earlier torn tails


def verify(ssd_dir: Path, acked: dict[str, float]) -> dict[str, int]:
    """Check ``ssd_dir`` after a kill; ``acked`` maps key hex -> start time of its latest acking trial."""
    now = time.time()  # no writer runs now: nothing can be evicted after this instant
    with SSDStore(crash.crash_config(str(ssd_dir))) as store:
        store.check_integrity(deep=True)
        keys = [BlockHash.from_hex(h) for h in sorted(acked)]
        got = store.get_many(keys)
        wrong = [k for k, g in zip(keys, got) if g is not None and g != crash.payload_for(k)]
        assert not wrong, f"{len(wrong)} keys served with a wrong payload, e.g. {wrong[:3]}"
        lost = [k for k, g in zip(keys, got) if g is None and acked[k.hex()] > now - crash.LIFETIME_S]
        assert not lost, f"{len(lost)} acknowledged keys lost inside their lifetime, e.g. {lost[:3]}"
        indexed = store.keys()
        served = store.get_many(indexed)
        assert all(g == crash.payload_for(k) for k, g in zip(indexed, served))
        st = store.stats()
        assert st.corrupt_records == 0 and st.misses == sum(g is None for g in got), st  # indexed = served
        store.check_integrity(deep=True)
        return {"entries": st.entries, "segments": st.segments, "missing": sum(g is None for g in got)}


def wait_ready(flag: Path, timeout_s: float = 10.0) -> None:
    """Until the writer's store is open (its start-up fsyncs every segment: ~100 ms on a slow disk, which
    would otherwise swallow most of the 0-150 ms kill window and leave the writing phase untested)."""
    deadline = time.monotonic() + timeout_s
    while not flag.exists() and time.monotonic() < deadline:
        time.sleep(0.002)


def test_sigkill_at_random_points_loses_nothing_acknowledged(tmp_path):
    rng = random.Random(20240501)
    acked: dict[Path, dict[str, float]] = {tmp_path / f"ssd{i}": {} for i in range(DIRS)}
    launcher = subprocess.Popen([sys.executable, str(HELPER)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=open(tmp_path / "launcher.err", "w"), text=True, bufsize=1)  # fmt: skip
    expired_seen = 0
    try:
        for trial in range(TRIALS):
            ssd_dir = list(acked)[trial % DIRS]
            keys_file = tmp_path / f"trial{trial}.keys"
            started = time.time()
            launcher.stdin.write(f"run {ssd_dir} {trial} {keys_file}\n")
            launcher.stdin.flush()
            line = launcher.stdout.readline().split()
            assert line[0] == "pid", (line, (tmp_path / "launcher.err").read_text())
            if trial % 4:  # 3 trials in 4 count the random moment from the end of the writer's start-up
                wait_ready(Path(f"{keys_file}.ready"))
            time.sleep(rng.uniform(0.0, 0.15))
            os.kill(int(line[1]), signal.SIGKILL)
            status = launcher.stdout.readline().split()
            assert status == ["exit", "-9"], (status, (tmp_path / "launcher.err").read_text())
            text = keys_file.read_text() if keys_file.exists() else ""
            acked[ssd_dir].update((h, started) for h in text.split("\n")[:-1])  # whole lines only
            info = verify(ssd_dir, acked[ssd_dir])
            expired_seen += info["missing"]
    finally:
        launcher.stdin.close()
        launcher.wait(10)
    assert sum(len(a) for a in acked.values()) > 500  # the writers really wrote
    assert expired_seen > 0  # and expired records were evicted under the kills
