"""The engine with its tiers: SSD write-through, snapshots at prompt/generation end, exact and
bounded-replay resume, restart on the same SSD directory and Redis (real redis-server on loopback).

float64 mode: an exact resume must give the tokens of a cold run of the same prompt; a resume by
encoder bounded replay must give the oracle's plan (c).
"""

import asyncio
import time

import torch

from flashtier.engine.config import EngineConfig
from flashtier.engine.engine import Engine
from flashtier.engine.model.reference import Plan, reference_forward
from flashtier.engine.sample.params import SamplingParams
from flashtier.engine.tiers.manager import TierManager
from flashtier.kvstore.block_hash import hash_blocks, namespace_hash
from flashtier.kvstore.config import KVStoreConfig
from flashtier.kvstore.snapshot.key import SnapshotKey

from ..kvstore.redis_server import RedisServer
from .conftest import random_prompt

BS = 16
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def _kv(tmp_path, **kw):
    return KVStoreConfig(block_size=BS, num_blocks=300, ssd_dir=str(tmp_path / "ssd"), **kw)


def _engine(model, kv_config, tiers=True):
    return Engine(model, EngineConfig(max_num_batched_tokens=256), kv_config,
                  TierManager(kv_config) if tiers else None)


def _turn(engine, rid, prompt, params=GREEDY):
    engine.add_request(rid, prompt, params)
    tokens, last = [], None
    for _ in range(10_000):
        if not engine.has_unfinished():
            break
        for out in engine.step():
            tokens += [t for c in out.choices for t in c.token_ids]
            last = out
        engine.check_integrity()
        if engine.scheduler.loading:
            time.sleep(0.002)  # a tier lookup is in flight on the I/O thread
    return tokens, last.cache


def _flush(engine):
    engine.tiers.writer.flush(timeout=10)
    for fut in list(engine.tiers._pending):
        fut.result(timeout=10)


def _cold(model, prompt):
    return _turn(Engine(model, EngineConfig(max_num_batched_tokens=256),
                        KVStoreConfig(block_size=BS, num_blocks=300, enable_prefix_caching=False)), "cold", prompt)[0]


def test_multi_turn_exact_resume_equals_cold_runs(tiny64, tmp_path):
    eng = _engine(tiny64, _kv(tmp_path))
    convo = random_prompt(70, seed=41)
    prev_len = None
    for turn in range(3):
        tokens, cache = _turn(eng, f"t{turn}", convo)
        assert tokens == _cold(tiny64, convo), f"turn {turn}"
        if turn:
            assert cache.snapshot_tokens > 0 or cache.cached_tokens % BS == 0
            assert cache.cached_tokens == prev_len - 1  # everything fed last turn (the last sample never is)
            assert cache.computed_tokens == len(convo) - cache.cached_tokens
        prev_len = len(convo) + len(tokens)
        convo = convo + tokens + random_prompt(20 + 7 * turn, seed=50 + turn)
        _flush(eng)
    stats = eng.stats().tiers
    assert stats["snapshot_lookup_hit"] == 2 and stats["ssd_blocks_written"] > 0
    eng.close()


def test_restart_resumes_from_ssd_and_redis(tiny64, tmp_path):
    server = RedisServer().start()
    try:
        cfg = _kv(tmp_path, redis_url=server.url)
        first = _engine(tiny64, cfg)
        convo = random_prompt(90, seed=42)
        tokens, _ = _turn(first, "a", convo)
        _flush(first)
        first.close()
        # a short follow-up: P = 101 lies 6 tokens (< window) before the end, so the decoder replay needs
        # the snapshot's replay tail, read back from Redis
        convo = convo + tokens + random_prompt(5, seed=43)
        second = _engine(tiny64, cfg)  # a fresh process would see exactly this: an empty pool
        got, cache = _turn(second, "b", convo)
        p = 90 + len(tokens) - 1
        assert (cache.cached_tokens, cache.ssd_tokens, cache.snapshot_tokens, cache.hbm_tokens) == (p, 96, p - 96, 0)
        assert second.stats().tiers["snapshot_lookup_hit"] == 1
        assert got == _cold(tiny64, convo)
        second.close()
    finally:
        server.stop()


def test_flushed_redis_falls_back_to_encoder_bounded_replay(tiny64, tiny_cfg, tmp_path):
    server = RedisServer().start()
    try:
        cfg = _kv(tmp_path, redis_url=server.url)
        eng = _engine(tiny64, cfg)
        convo = random_prompt(100, seed=44)
        tokens, _ = _turn(eng, "a", convo)
        _flush(eng)
        server.client().flushall()
        convo = convo + tokens + random_prompt(30, seed=45)
        got, cache = _turn(eng, "b", convo)
        r = (100 + len(tokens) - 1) // BS * BS
        assert cache.cached_tokens == r and cache.snapshot_tokens == 0
        assert cache.approximate_replay_tokens == tiny_cfg.sliding_window
        seq = torch.tensor(convo + got[:-1])
        ref = reference_forward(tiny64, seq, Plan.resume(r, len(convo), seq.numel(), tiny_cfg.sliding_window))
        assert torch.argmax(ref.logits, -1).tolist() == got
        assert eng.stats().tiers["snapshot_lookup_hit"] == 0
        eng.close()
    finally:
        server.stop()


def test_stopped_redis_is_a_miss_not_a_failure(tiny64, tmp_path):
    server = RedisServer().start()
    cfg = _kv(tmp_path, redis_url=server.url, redis_timeout_s=0.2)
    eng = _engine(tiny64, cfg)
    convo = random_prompt(60, seed=46)
    tokens, _ = _turn(eng, "a", convo)
    server.stop()
    convo = convo + tokens + random_prompt(20, seed=47)
    got, cache = _turn(eng, "b", convo)
    assert got == _cold(tiny64, convo) or cache.approximate_replay_tokens > 0  # served, never failed
    assert len(got) == GREEDY.max_tokens
    stats = eng.stats().tiers
    assert stats["snapshot_redis_errors"] > 0
    assert stats["snapshot_lookup_error"] == 1 and stats["snapshot_lookup_none"] == 1  # a down pool is an error
    eng.close()


def test_a_repeated_prompt_does_not_overwrite_the_exact_snapshot(tiny64, tmp_path):
    """A, A again, then B = A + reply + new turn: B equals a cold run of B.

    A repeat normally resumes exactly from the first A's prompt-end snapshot at P = n
    (tests/engine/test_exact_retry.py). Here that snapshot is deleted, so the repeat finds the prefix
    without a usable exact snapshot, replays from a block boundary and ends with an approximate window
    state: that state must never be stored as exact (a third A resumes it as a replay, not as exact), and
    B resumes from the first A's exact generation-end snapshot.
    """
    eng = _engine(tiny64, _kv(tmp_path))
    a = random_prompt(134, seed=60)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)  # both snapshots in block 8
    first, _ = _turn(eng, "a1", a, params)
    _flush(eng)
    ns = namespace_hash(eng.fingerprint, None)
    b_end = 134 // BS
    prompt_end = SnapshotKey.for_tail(ns, hash_blocks(ns, a, BS)[b_end - 1], a[b_end * BS :])
    assert asyncio.run_coroutine_threadsafe(eng.tiers.snapshots.delete(prompt_end), eng.tiers._loop).result(10)
    again, cache = _turn(eng, "a2", a, params)
    assert cache.approximate_replay_tokens > 0 and cache.snapshot_tokens == 0  # the repeat really replayed
    assert again != first  # the approximate window changed the answer: its state differs
    _flush(eng)
    third, cache = _turn(eng, "a3", a, params)
    assert third == again and cache.snapshot_tokens == 134 - b_end * BS  # the repeat's replayed snapshot ...
    assert eng.scheduler.requests == {} and cache.approximate_replay_tokens == 0  # ... resumed, not replayed
    _flush(eng)
    b = a + first + random_prompt(30, seed=61)
    got, cache = _turn(eng, "b", b)
    assert got == _cold(tiny64, b)
    assert cache.snapshot_tokens == 134 + 8 - 1 - 128  # the first A's exact generation-end snapshot
    eng.close()
