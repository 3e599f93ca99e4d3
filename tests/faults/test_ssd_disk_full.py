"""SSD writes failing (a full filesystem): every request completes, answers stay right, failures counted.

The --kv-dir lives on a 2 MiB tmpfs (``mount -t tmpfs -o size=2m``; skipped where mounting is not
allowed) that a filler file leaves 64 KiB of: about 29 block records of the tiny model at block size 16.
Three clients run conversations; the SSD writes soon fail with ENOSPC. Then:

- every request completes and equals the cold server (exact resumes from HBM + Redis snapshots);
- the failures are counted (``ssd_write_errors_total{cause="disk_full"}``) and the server logs the
  "disk full" WARNING once, however many writes fail;
- the filler is deleted: writes recover (one "writes recovered" WARNING, blocks written again);
- the server is stopped and restarted on the same directory (whose segments hold the tails of failed
  appends): the start-up scan accepts it, and each conversation's next turn resumes from the SSD with a
  right answer: exact where the blocks under a snapshot were written, else a bounded replay from the
  blocks that were (the oracle's plan (c)).
"""

from __future__ import annotations

import os
import subprocess
import time

import pytest

from ..kvstore.redis_server import RedisServer
from .conftest import Conversation, FaultServer, Load, Tally, dump_trace, record, verify, wrong_turns

FS_BYTES = 2 << 20
LEAVE_FREE = 64 << 10


def _mount_tmpfs(path) -> str:
    """Mount a FS_BYTES tmpfs on ``path``; '' on success, else why not."""
    path.mkdir()
    try:
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={FS_BYTES},mode=0700", "tmpfs", str(path)],
                           capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"mount failed: {exc}"
    if r.returncode != 0:
        return f"mount -t tmpfs failed ({r.returncode}): {r.stderr.strip()}"
    return ""


def _unmount(path) -> None:
    """Unmount the tmpfs; if something still holds it ("busy": a process that has not let go of a file yet), detach
    it lazily (``umount -l``: the kernel frees it when the last holder closes), so no run leaves it mounted under
    a directory pytest later tries to remove."""
    r = subprocess.run(["umount", str(path)], capture_output=True, timeout=60)
    if r.returncode != 0:
        subprocess.run(["umount", "-l", str(path)], capture_output=True, timeout=60)


def _fill(path, leave: int) -> None:
    """A filler file that leaves about ``leave`` bytes free on the filesystem of ``path``."""
    st = os.statvfs(path.parent)
    free = st.f_bavail * st.f_frsize
    with open(path, "wb") as f:
        f.write(b"\0" * max(0, free - leave))
        f.flush()
        os.fsync(f.fileno())


@pytest.mark.slow
def test_disk_full_costs_misses_not_requests(tmp_path, fault_cache, cold, oracle):
    if os.geteuid() != 0:
        pytest.skip("needs root to mount a small tmpfs (the SSD tier's disk-full scenario)")
    small = tmp_path / "small"
    why = _mount_tmpfs(small)
    if why:
        pytest.skip(f"cannot mount a tmpfs here ({why}): the disk-full scenario needs a tiny filesystem")
    t0 = time.monotonic()
    redis = RedisServer()
    srv = None
    tally = Tally("SSD tier on a full filesystem (ENOSPC), then space freed, then restart")
    convs = [Conversation(cid, first=300 + 40 * cid, step=48) for cid in range(3)]
    observed: dict = {}
    try:
        kv = small / "kv"
        kv.mkdir(mode=0o700)
        _fill(small / "filler", LEAVE_FREE)
        redis.start()
        srv = FaultServer(fault_cache, tmp_path, "diskfull", "--kv-dir", str(kv), "--redis-url", redis.url)
        srv.start()
        srv.warm()
        with Load(srv, convs, cold) as load:
            load.set_phase("disk full")
            load.wait_turns(2)
            full = srv.metric_map("flashtier_ssd_")
            log_full = srv.log_text()
            (small / "filler").unlink()
            load.set_phase("space freed")
            load.wait_turns(2)
        freed = srv.metric_map("flashtier_ssd_")
        log_freed = srv.log_text()
        srv.stop()
        srv.start()
        srv.warm()
        restarted = srv.metric_map("flashtier_ssd_")
        after = []  # one turn each, in turn: the first resume of every conversation from the SSD
        for conv in convs:
            prompt = conv.prompt
            after.append(record(conv, "after restart", prompt, srv.post(prompt), cold))
            if after[-1].reply.ok:
                conv.advance(after[-1].reply.tokens)
        turns = load.turns + after
        assert not load.failure, load.failure
        verify(turns, cold, oracle)
        dump_trace("diskfull", turns, cold)
        tally.add(turns)

        errors = full['flashtier_ssd_write_errors_total{cause=disk_full}']
        lines = [ln for ln in log_freed.splitlines() if "flashtier.kvstore.ssd" in ln and "disk full (" in ln]
        recovered = [ln for ln in log_freed.splitlines() if "writes recovered" in ln]
        observed.update({
            "ssd_write_errors{disk_full} while full": errors,
            "ssd_blocks_written while full": full.get("flashtier_ssd_blocks_written_total"),
            "ssd_blocks_written after space freed": freed.get("flashtier_ssd_blocks_written_total"),
            "log: 'disk full' WARNING lines": len(lines),
            "log: 'writes recovered' WARNING lines": len(recovered),
            "restart: ssd_corrupt_records": restarted.get("flashtier_ssd_corrupt_records_total"),
            "restart: ssd_torn_bytes": restarted.get("flashtier_ssd_torn_bytes_total"),
            "restart: ssd_entries": restarted.get("flashtier_ssd_entries"),
            "after restart: cached tokens from ssd": [t.reply.usage["flashtier"]["cached_tokens_by_tier"]["ssd"]
                                                      for t in after if t.reply.ok],
            "after restart: resume kinds": [t.kind for t in after],
        })
        tally.observed = observed
        assert tally.completed == tally.sent, (tally.sent, tally.completed)
        assert tally.wrong == 0, "\n".join(wrong_turns(turns))
        assert errors > 1, full  # many writes failed ...
        assert len([ln for ln in log_full.splitlines() if "disk full (" in ln]) == 1, log_full  # ... one line
        assert len(lines) == 1 and " WARNING " in lines[0], lines
        assert len(recovered) == 1 and " WARNING " in recovered[0], log_freed
        assert freed["flashtier_ssd_blocks_written_total"] > full["flashtier_ssd_blocks_written_total"], freed
        # blocks written before the disk filled are served (a failed write is never retried: holes end prefixes)
        assert any(t.reply.usage["flashtier"]["cached_tokens_by_tier"]["ssd"] > 0 for t in after), observed
    finally:
        if srv is not None:
            srv.kill()
        redis.close()
        _unmount(small)
        tally.seconds = round(time.monotonic() - t0, 1)
        tally.report()
