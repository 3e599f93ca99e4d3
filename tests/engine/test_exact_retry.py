"""The same request again resumes exactly (float64, tiny preset, window 16, block size 16).

A retry after a timeout, "regenerate" in a chat client, n > 1 sent as separate requests, an agent harness
re-sending a turn: the second request's prompt is the first one's, token for token. Its resume point is
the first request's prompt-end snapshot at P = n (the encoder fed nothing more; the decoder replay reads
the snapshot's replay tail), so it must report ``exact`` and give the first answer's tokens — greedy,
and at temperature > 0 with the same seed — while its state is in the tiers: in-process (HBM hits + the
snapshot), after the HBM copy is evicted (SSD blocks + the snapshot), and across a restart with Redis.
Before P = n was a candidate (``P < n``), the retry found no usable snapshot and resumed by an encoder
bounded replay from the last block boundary: ``replay``, with different tokens.

Lookups are waited for on their futures, never with sleeps.
"""

import asyncio
import os

import pytest

from flashtier.engine.config import EngineConfig
from flashtier.engine.engine import Engine
from flashtier.engine.sample.params import SamplingParams
from flashtier.engine.tiers.manager import TierManager
from flashtier.kvstore.config import KVStoreConfig
from flashtier.kvstore.snapshot.persist import FILE_NAME

from ..kvstore.redis_server import RedisServer
from .conftest import random_prompt

BS = 16
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=8, ignore_eos=True)


def _kv(tmp_path, **kw):
    return KVStoreConfig(block_size=BS, num_blocks=300, ssd_dir=str(tmp_path / "ssd"), **kw)


def _engine(model, kv_config):
    return Engine(model, EngineConfig(max_num_batched_tokens=256), kv_config, TierManager(kv_config))


def _turn(engine, rid, prompt, params):
    """Run one request to its end; (tokens, last RequestOutput). Waits on tier lookups' futures."""
    engine.add_request(rid, prompt, params)
    tokens, last = [], None
    for _ in range(10_000):
        if not engine.has_unfinished():
            break
        for req in list(engine.scheduler.loading):
            req.lookup.result(timeout=60)  # the I/O thread's lookup; the step installs it
        for out in engine.step():
            tokens += [t for c in out.choices for t in c.token_ids]
            last = out
        engine.check_integrity()
    return tokens, last


def _flush(engine):
    """Every SSD write and snapshot put of the engine is done (waits on their futures)."""
    engine.tiers.writer.flush(timeout=10)
    for fut in list(engine.tiers._pending):
        fut.result(timeout=10)


def _cold(model, prompt, params):
    eng = Engine(model, EngineConfig(max_num_batched_tokens=256),
                 KVStoreConfig(block_size=BS, num_blocks=300, enable_prefix_caching=False))
    return _turn(eng, "cold", prompt, params)[0]


def _assert_exact_retry(out, n, *, hbm_tokens, ssd_tokens):
    cache = out.cache
    assert (out.resume.kind, out.resume.replay_from) == ("exact", None)
    assert cache.cached_tokens == n and cache.computed_tokens == 0  # nothing re-encoded
    assert (cache.hbm_tokens, cache.ssd_tokens, cache.snapshot_tokens) == (hbm_tokens, ssd_tokens, n % BS)


@pytest.mark.parametrize("n", [150, 160])  # a 6-token tail block; P block-aligned
@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_the_same_request_twice_resumes_exactly(tiny64, tmp_path, n, params):
    eng = _engine(tiny64, _kv(tmp_path))
    prompt = random_prompt(n, seed=70 + n)
    first, out1 = _turn(eng, "a1", prompt, params)
    assert out1.resume.kind == "cold"
    _flush(eng)
    again, out2 = _turn(eng, "a2", prompt, params)
    _assert_exact_retry(out2, n, hbm_tokens=n // BS * BS, ssd_tokens=0)
    assert again == first == _cold(tiny64, prompt, params)
    assert eng.stats().tiers["snapshot_lookup_hit"] == 1
    # and a third time (the retry put no new prompt-end snapshot; the first one still serves)
    _flush(eng)
    third, out3 = _turn(eng, "a3", prompt, params)
    assert out3.resume.kind == "exact" and third == first
    eng.close()


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_a_retry_after_the_hbm_copy_is_evicted_resumes_from_ssd_and_the_pool(tiny64, tmp_path, params):
    eng = _engine(tiny64, _kv(tmp_path))
    prompt = random_prompt(150, seed=80)
    first, _ = _turn(eng, "a1", prompt, params)
    _flush(eng)
    assert eng.pool.reset_prefix_cache()  # the HBM prefix cache is gone; SSD and the snapshot pool remain
    again, out = _turn(eng, "a2", prompt, params)
    _assert_exact_retry(out, 150, hbm_tokens=0, ssd_tokens=144)
    assert again == first
    eng.close()


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_a_retry_after_a_restart_with_redis_resumes_exactly(tiny64, tmp_path, params):
    server = RedisServer().start()
    try:
        cfg = _kv(tmp_path, redis_url=server.url)
        eng = _engine(tiny64, cfg)
        prompt = random_prompt(150, seed=90)
        first, _ = _turn(eng, "a1", prompt, params)
        _flush(eng)
        eng.close()
        eng = _engine(tiny64, cfg)  # a fresh process sees exactly this: empty HBM, the SSD dir, Redis
        again, out = _turn(eng, "a2", prompt, params)
        _assert_exact_retry(out, 150, hbm_tokens=0, ssd_tokens=144)
        assert again == first
        eng.close()
    finally:
        server.stop()


def test_a_retried_replay_stays_a_replay(tiny64, tiny_cfg, tmp_path):
    """A prompt whose first answer came from a bounded replay: its prompt-end snapshot is approximate
    (replayed namespace), so its retry resumes that state and says ``replay`` with the same R, never
    ``exact``; and it gives the same tokens as the first replayed answer."""
    eng = _engine(tiny64, _kv(tmp_path))
    base = random_prompt(100, seed=95)
    t1, _ = _turn(eng, "t1", base, GREEDY)
    _flush(eng)
    # drop every exact snapshot, so the next turn resumes by a bounded replay
    pool = eng.tiers.snapshots
    for key in list(pool._lru):
        assert _run(eng, pool.delete(key))
    convo = base + t1 + random_prompt(30, seed=96)
    first, out1 = _turn(eng, "b1", convo, GREEDY)
    assert out1.resume.kind == "replay"
    _flush(eng)
    again, out2 = _turn(eng, "b2", convo, GREEDY)
    assert (out2.resume.kind, out2.resume.replay_from) == ("replay", out1.resume.replay_from)
    assert again == first
    eng.close()


def _run(engine, coro):
    """Run a pool coroutine on the tiers' I/O loop and wait for it."""
    return asyncio.run_coroutine_threadsafe(coro, engine.tiers._loop).result(timeout=10)


# greedy only: the seeded retries above already cover a seed's draws across a resume (make test's time)
@pytest.mark.parametrize("params", [GREEDY], ids=["greedy"])
def test_a_clean_restart_without_redis_resumes_exactly(tiny64, tmp_path, params):
    """The embedded pool is saved beside the SSD tier at a clean shutdown and loaded at start-up: a retry
    and a next turn after the restart both resume exactly (before: the pool was empty, every resume a
    replay). The control run deletes the file (what a SIGKILL leaves): the same retry is a replay."""
    cfg = _kv(tmp_path)  # no redis_url: the embedded pool
    eng = _engine(tiny64, cfg)
    prompt = random_prompt(150, seed=97)
    first, _ = _turn(eng, "a1", prompt, params)
    _flush(eng)
    eng.close()  # clean shutdown: the pool's 2 snapshots go to KV_DIR/snapshots.embedded
    eng = _engine(tiny64, cfg)
    assert eng.stats().tiers["snapshot_restored"] == 2
    again, out = _turn(eng, "a2", prompt, params)
    _assert_exact_retry(out, 150, hbm_tokens=0, ssd_tokens=144)
    assert again == first
    nxt = prompt + first + random_prompt(20, seed=98)
    got, out = _turn(eng, "b", nxt, GREEDY)
    assert out.resume.kind == "exact" and got == _cold(tiny64, nxt, GREEDY)
    eng.close()
    os.unlink(tmp_path / "ssd" / FILE_NAME)  # control: a restart that lost the pool (SIGKILL)
    eng = _engine(tiny64, cfg)
    again, out = _turn(eng, "a3", prompt, params)
    assert out.resume.kind == "replay" and out.cache.approximate_replay_tokens == 16
    eng.close()
