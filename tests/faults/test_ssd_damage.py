"""Damaged SSD segment files while the server is stopped: a damaged record is a counted miss, never served.

Three conversations (A, B, C) run two turns each, one after the other, so the one segment file holds
A's blocks, then B's, then C's, in order (checked: 3 x 24 records, distinct keys). The server is stopped
(SIGTERM: everything flushed) and the file is damaged:

- A: one byte of a record header flipped (block 20, above A's turn-1 snapshot at 303): the start-up scan
  counts it corrupt and drops it; A's next turn resumes exactly from the turn-1 snapshot below it;
- B: one byte of a record payload flipped (block 20): the header is fine, so the record is indexed; the
  read's checksum refuses it (counted corrupt), so B's lookup gets 20 blocks;
- C: the file's tail cut in the middle of its last record (C's block 23): the scan drops the torn tail
  (counted in torn bytes); C resumes exactly from its turn-1 snapshot.

After a restart on the same directory and Redis, every answer equals the cold server's (exact and cold
resumes) or the oracle's plan (c) (a bounded replay, which is what a lookup that loses a block under the
snapshot it found does: see docs/reliability.md), and the counters show the damage.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from flashtier.kvstore.ssd.record import HEADER_BYTES, decode_header

from ..kvstore.redis_server import RedisServer
from .conftest import BS, Conversation, FaultServer, Tally, Turn, dump_trace, record, verify, wrong_turns

FIRST, STEP = 300, 80
BLOCKS_PER_CONV = 24  # (300 + 4 + 80 + 4 - 1) // 16 full blocks after two turns
DAMAGED_BLOCK = 20


def _records(path: Path) -> list[tuple[int, int, bytes]]:
    """(offset, record bytes, key digest) of every record of an undamaged segment file, in file order."""
    data = path.read_bytes()
    out, off = [], 0
    while off < len(data):
        h = decode_header(data[off : off + HEADER_BYTES])
        out.append((off, h.record_bytes, h.key.digest))
        off += h.record_bytes
    assert off == len(data), "the segment ends inside a record"
    return out


def _flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x5A]))
        f.flush()
        os.fsync(f.fileno())


@pytest.mark.slow
def test_damaged_segments_are_counted_misses_and_answers_stay_right(tmp_path, fault_cache, cold, oracle):
    t0 = time.monotonic()
    kv = tmp_path / "kv"
    redis = RedisServer()
    srv = None
    tally = Tally("SSD segment damaged while stopped: header byte flipped, payload byte flipped, tail truncated")
    convs = [Conversation(cid, first=FIRST, step=STEP) for cid in range(3)]
    turns: list[Turn] = []
    try:
        redis.start()
        srv = FaultServer(fault_cache, tmp_path, "damage", "--kv-dir", str(kv), "--redis-url", redis.url)
        srv.start()  # no warm-up here: the segment must hold nothing but A's, B's and C's blocks
        for conv in convs:  # one after the other: the segment holds A's blocks, then B's, then C's
            for _ in range(2):
                prompt = conv.prompt
                reply = srv.complete(prompt)
                turns.append(record(conv, "before damage", prompt, reply, cold))
                conv.advance(reply.tokens)
        srv.stop()

        segments = sorted(kv.glob("*.seg"))
        assert len(segments) == 1, segments
        seg = segments[0]
        recs = _records(seg)
        assert len(recs) == 3 * BLOCKS_PER_CONV and len({k for _, _, k in recs}) == len(recs), len(recs)
        a_off, _, _ = recs[DAMAGED_BLOCK]
        _flip(seg, a_off + 10)  # A: a byte of the key, inside the header checksum
        b_off, b_len, _ = recs[BLOCKS_PER_CONV + DAMAGED_BLOCK]
        _flip(seg, b_off + HEADER_BYTES + (b_len - HEADER_BYTES) // 2)  # B: the middle of the payload
        c_off, c_len, _ = recs[-1]
        torn = HEADER_BYTES + (c_len - HEADER_BYTES) // 2
        os.truncate(seg, c_off + torn)  # C: the last record cut in half

        srv.start()
        at_start = srv.metric_map("flashtier_ssd_")
        srv.warm()
        assert at_start["flashtier_ssd_corrupt_records_total"] == 1, at_start  # A's header, found by the scan
        assert at_start["flashtier_ssd_torn_bytes_total"] == torn, at_start  # C's half record
        assert at_start["flashtier_ssd_entries"] == 3 * BLOCKS_PER_CONV - 2, at_start  # B's is indexed (for now)
        after = []
        for conv in convs:
            prompt = conv.prompt
            reply = srv.complete(prompt)
            t = record(conv, "after damage", prompt, reply, cold)
            turns.append(t)
            after.append(t)
            conv.advance(reply.tokens)
        at_end = srv.metric_map("flashtier_ssd_")
        verify(turns, cold, oracle)
        dump_trace("damage", turns, cold)
        tally.add(turns)
        a, b, c = (t.reply.usage for t in after)
        cached = [u["prompt_tokens_details"]["cached_tokens"] for u in (a, b, c)]
        tally.observed = {
            "ssd_corrupt_records at start-up": at_start["flashtier_ssd_corrupt_records_total"],
            "ssd_torn_bytes at start-up": at_start["flashtier_ssd_torn_bytes_total"],
            "ssd_corrupt_records after the reads": at_end["flashtier_ssd_corrupt_records_total"],
            "ssd_misses after the reads": at_end["flashtier_ssd_misses_total"],
            "resume kinds A, B, C": [t.kind for t in after],
            "cached tokens A, B, C": cached,
        }
        assert tally.wrong == 0, "\n".join(wrong_turns(turns))
        assert tally.completed == tally.sent == 9
        # A and C resume exactly from the snapshot below their damaged block; B's checksum failure is counted
        assert after[0].kind == "exact" and cached[0] == FIRST + 3, a
        assert after[2].kind == "exact" and cached[2] == FIRST + 3, c
        assert cached[1] >= DAMAGED_BLOCK * BS and b["flashtier"]["cached_tokens_by_tier"]["ssd"] <= DAMAGED_BLOCK * BS
        assert at_end["flashtier_ssd_corrupt_records_total"] == 2, at_end  # + B's payload, refused on read
    finally:
        if srv is not None:
            srv.kill()
        redis.close()
        tally.seconds = round(time.monotonic() - t0, 1)
        tally.report()
