"""Warm-up (engine/warmup.py) on the tiny model, CPU: it runs every requested batch size through the real step,
leaves no request, no counter change and nothing in the tiers behind, and changes no answer (a request after
a warm-up gives the tokens a fresh engine gives)."""

from __future__ import annotations

import copy

import pytest

from flashtier.engine.config import EngineConfig
from flashtier.engine.factory import build_engine
from flashtier.engine.parallel import ParallelConfig
from flashtier.engine.parallel.executor import start_engine_core
from flashtier.engine.sample.params import SamplingParams
from flashtier.engine.warmup import WARMUP_SALT, warm_up
from flashtier.kvstore.config import KVStoreConfig

PROMPT = [11 + (7 * i) % 500 for i in range(40)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def engine_with_tiers(tmp_path, **config):
    kv = KVStoreConfig(block_size=16, num_blocks=96, ssd_dir=str(tmp_path / "kv"))
    return build_engine(EngineConfig(preset="tiny", weights_seed=0, max_num_seqs=4, **config), kv, tiers=True)


def generate(engine, rid="r"):
    engine.add_request(rid, PROMPT, GREEDY)
    tokens = []
    while engine.has_unfinished():
        for out in engine.step():
            tokens += [t for c in out.choices for t in c.token_ids]
    return tokens


@pytest.fixture(scope="module")
def fresh_tokens(tmp_path_factory):
    engine = engine_with_tiers(tmp_path_factory.mktemp("fresh"))
    try:
        return generate(engine)
    finally:
        engine.close()


def test_warm_up_leaves_nothing_behind_and_changes_no_answer(tmp_path, fresh_tokens):
    engine = engine_with_tiers(tmp_path)
    try:
        stats, stats_before, prompt_tokens = engine.scheduler.stats, copy.copy(engine.scheduler.stats), \
            engine.prompt_tokens
        lengths = []
        add = engine.add_request
        engine.add_request = lambda rid, prompt, *a, **k: (lengths.append(len(prompt)), add(rid, prompt, *a, **k))[1]
        report = warm_up(engine, sizes=(1, 3))
        del engine.add_request
        assert report.sizes == (1, 3) and len(report.seconds) == 2
        # one block + 8 at the smallest size, then 4 blocks, 4 blocks + 16, the whole token budget (512) and two
        # budgets + 24, capped by half the pool (96 blocks of 16) less its decode steps: 2 chunks; 8 at larger sizes
        assert report.long_prompts == (64, 80, 512, 755) and lengths == [24, 64, 80, 512, 755, 8, 8, 8], lengths
        assert not engine.has_unfinished() and engine.scheduler.requests == {}
        assert engine.scheduler.stats is stats and stats == stats_before and engine.prompt_tokens == prompt_tokens
        assert engine.scheduler.tiers is not None  # reattached
        tiers = engine.tiers
        assert tiers.stats.ssd_blocks_written == 0 and tiers.stats.snapshot_puts == 0 and tiers.stats.lookups == 0
        assert engine.kvm.pool.num_used == 0  # only free, evictable throwaway blocks stay cached
        assert generate(engine) == fresh_tokens
    finally:
        engine.close()


def test_a_failing_warm_up_reattaches_the_tiers_and_drops_its_requests(tmp_path, monkeypatch):
    engine = engine_with_tiers(tmp_path)
    try:
        def broken():
            raise RuntimeError("kernel compile failed")

        monkeypatch.setattr(engine, "step", broken)
        with pytest.raises(RuntimeError, match="kernel compile failed"):
            warm_up(engine, sizes=(2,))
        assert engine.scheduler.tiers is not None
        monkeypatch.undo()
        while engine.has_unfinished():  # the aborts are collected by the next step
            engine.step()
        assert engine.scheduler.requests == {}
    finally:
        engine.close()


def test_the_engine_core_reports_the_warm_up_phase_before_ready():
    """The spawned engine core warms up before it reports ready, saying so first (``/health``'s phase)."""
    import asyncio

    phases = []
    kv = KVStoreConfig(block_size=16, num_blocks=96)
    client = start_engine_core(ParallelConfig(), EngineConfig(preset="tiny", max_num_seqs=2, warmup=True,
                                                              cuda_graph_sizes=(1, 2)), kv, seed=0, threads=1,
                               phase=phases.append, start_timeout_s=300)
    try:
        assert phases == ["warming up"] and client.is_ready()
        assert client._ready_info().warmup_s > 0
        assert client.stats().prompt_tokens == 0  # the throwaway requests left no trace in the counters
    finally:
        asyncio.run(client.shutdown(5))


def test_the_warm_up_namespace_is_out_of_reach_of_requests():
    """A request's cache_salt is 1-256 printable characters (server/serving/request_checks.py): never a NUL."""
    assert "\x00" in WARMUP_SALT


def test_a_speculative_engine_warms_its_verify_graphs():
    """The verify set (graphs that return the draft inputs) gets one bucket per row size, over pad rows, without
    a step reaching it; a plain engine gets none; a second warm-up makes none again. On the CPU the graph
    object runs its padded program eagerly (``capture=False``): the buckets, not the captures, are checked."""
    from flashtier.engine.runner.decode_graphs import MIN_TABLE, DecodeGraphs

    for depth in (3, 0):
        # a fixed draft length: which steps verify does not hang on the controller's clock
        config = EngineConfig(preset="tiny", weights_seed=0, max_num_seqs=4, speculative_tokens=depth,
                              speculative_adaptive=False)
        engine = build_engine(config, KVStoreConfig(block_size=16, num_blocks=96))
        try:
            paged = engine.runner.paged
            paged.graphs = DecodeGraphs(engine.model, paged.views, engine.kvm.arena.pad_slot, paged.sources,
                                        capture=False, max_rows=4, sizes=(1, 2))
            report = warm_up(engine, sizes=(1,))
            taps = engine.runner.taps
            verify = {k for k in paged.graphs._buckets if k[2]}
            if depth:  # the throwaway steps verified chunks too (wider tables among them): prepare made the rest
                wanted = {(rows, MIN_TABLE, taps) for rows in (1, 2, 4)}
                assert taps and verify >= wanted and 0 <= report.verify_graphs <= 3
                assert warm_up(engine, sizes=(1,)).verify_graphs == 0
                fresh = DecodeGraphs(engine.model, paged.views, engine.kvm.arena.pad_slot, paged.sources,
                                     capture=False, max_rows=4, sizes=(1, 2))
                assert [fresh.prepare(r, taps) for r in (1, 2, 3, 4, 5)] == [True, True, True, False, False]
                assert set(fresh._buckets) == wanted
            else:
                assert not taps and report.verify_graphs == 0 and not verify
            assert generate(engine) == generate(build_engine(config, KVStoreConfig(block_size=16, num_blocks=96)))
        finally:
            engine.close()
