"""A tenant's deletion in a running engine (``EngineCoreClient.delete_tenant``, driving the engine-core loop
over its pipe): the HBM prefix index (between two steps), the SSD tier (records rewritten out of every file) and the embedded snapshot pool; another
tenant keeps its hits, and a request of the deleted tenant that is running meanwhile is not disturbed."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from flashtier.engine.config import EngineConfig
from flashtier.engine.engine import Engine
from flashtier.engine.sample.params import SamplingParams
from flashtier.engine.tiers.manager import TierManager
from flashtier.kvstore.block_hash import namespace_hash
from flashtier.kvstore.config import KVStoreConfig
from flashtier.kvstore.tenant import tenant_tag

from .conftest import random_prompt
from .engine_core_harness import in_process_engine_core
from ..kvstore.ssd_store_support import ssd_payloads

BS = 16
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def _engine(model, tmp_path: Path, tiers: bool = True, caching: bool = True) -> Engine:
    kv = KVStoreConfig(block_size=BS, num_blocks=300, ssd_dir=str(tmp_path / "ssd") if tiers else None,
                       enable_prefix_caching=caching)
    return Engine(model, EngineConfig(max_num_batched_tokens=256), kv, TierManager(kv) if tiers else None)


async def _run(eng, rid: str, prompt: list[int], salt: str):
    tokens, last = [], None
    async for out in eng.generate(rid, prompt, GREEDY, cache_salt=salt):
        tokens += [t for c in out.choices for t in c.token_ids]
        last = out
    return tokens, last.cache


def test_delete_tenant_clears_hbm_ssd_and_snapshots_and_keeps_the_other(tiny64, tmp_path):
    engine = _engine(tiny64, tmp_path)
    prompts = {"acme": random_prompt(70, seed=61), "other": random_prompt(70, seed=62)}

    async def go():
        eng = in_process_engine_core(engine)
        try:
            first = {s: await _run(eng, f"{s}-1", p, s) for s, p in prompts.items()}
            engine.tiers.writer.flush(timeout=30)
            for fut in list(engine.tiers._pending):  # snapshot puts queued on the I/O loop
                fut.result(timeout=30)
            hits = {s: (await _run(eng, f"{s}-2", p, s))[1] for s, p in prompts.items()}
            assert hits["acme"].cached_tokens >= 64 and hits["other"].cached_tokens >= 64  # could fail below
            before = ssd_payloads(tmp_path / "ssd")
            snaps = engine.tiers.snapshots
            acme_ns = namespace_hash(engine.fingerprint, "acme")
            assert any(k.namespace == acme_ns for k in list(snaps._lru))
            n_other = sum(1 for k in list(snaps._lru) if k.namespace != acme_ns)

            started = time.perf_counter()
            rep = await eng.delete_tenant("acme")
            took = time.perf_counter() - started
            print(f"\nengine delete_tenant: {took * 1000:.1f} ms, {rep}")
            assert rep.tenant_tag == tenant_tag("acme").hex()
            assert rep.hbm_free_blocks >= 4 and rep.hbm_in_use_blocks == 0
            assert rep.ssd_records_deleted == len(before[tenant_tag("acme")]) and rep.ssd_live_deleted >= 4
            assert rep.snapshots_deleted >= 1
            after = ssd_payloads(tmp_path / "ssd")
            assert tenant_tag("acme") not in after and after[tenant_tag("other")] >= before[tenant_tag("other")]
            for payload in before[tenant_tag("acme")]:
                assert not any(payload in p.read_bytes() for p in (tmp_path / "ssd").rglob("*") if p.is_file())
            assert not any(k.namespace == acme_ns for k in list(snaps._lru))
            assert sum(1 for k in list(snaps._lru) if k.namespace != acme_ns) == n_other
            engine.pool.check_integrity()

            tokens, cache = await _run(eng, "acme-3", prompts["acme"], "acme")
            assert (cache.cached_tokens, cache.hbm_tokens, cache.ssd_tokens, cache.snapshot_tokens) == (0, 0, 0, 0)
            assert tokens == first["acme"][0]
            tokens, cache = await _run(eng, "other-3", prompts["other"], "other")
            assert cache == hits["other"] and tokens == first["other"][0]
            again = await eng.delete_tenant("acme")  # idempotent: what the last request cached goes
            assert again.ssd_records_deleted >= 0 and again.hbm_free_blocks >= 4
        finally:
            await eng.shutdown(timeout=5)

    asyncio.run(go())


def test_blocks_in_use_are_uncached_but_their_request_finishes_unchanged(tiny64, tmp_path):
    """Deleted while its request runs: the blocks stay the request's (tokens equal a cold run's), leave the
    index at once, and are plain free space once it finishes."""
    prompt = random_prompt(70, seed=63)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    cold = _engine(tiny64, tmp_path / "cold", tiers=False, caching=False)
    cold.add_request("c", prompt, params)
    want = []
    while cold.has_unfinished():
        want += [t for out in cold.step() for c in out.choices for t in c.token_ids]

    eng = _engine(tiny64, tmp_path, tiers=False)
    eng.add_request("r", prompt, params, cache_salt="acme")
    got, dropped = [], None
    while eng.has_unfinished():
        got += [t for out in eng.step() for c in out.choices for t in c.token_ids]
        eng.check_integrity()
        if dropped is None and len(got) >= 3:
            dropped, _ = eng.drop_tenant("acme")
            assert dropped.in_use_blocks >= 4 and dropped.free_blocks == 0
            eng.check_integrity()
    assert got == want
    eng.pool.check_integrity()
    eng.add_request("r2", prompt, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True), cache_salt="acme")
    outs = []
    while eng.has_unfinished():
        outs += eng.step()
    assert outs[-1].cache.cached_tokens == 0  # the blocks cached before the deletion are not found
