"""The engine resuming from the SSD tier through the restore buffer gives the pool bytes, tokens and
logprobs of the bytes path (``restore_bytes_oracle``: ``get_many`` + ``load_block`` per image), bit for
bit: an exact resume (snapshot + SSD blocks) and a bounded replay over SSD blocks (snapshots gone).
Each run: turn A, its blocks made durable, the HBM prefix cache emptied, then turn B = A + reply + more,
whose full blocks can only come from the SSD. float64 tiny model, CPU."""

import time

import pytest
import torch

from flashtier.engine.config import EngineConfig
from flashtier.engine.engine import Engine
from flashtier.engine.sample.params import SamplingParams
from flashtier.engine.tiers.manager import TierManager
from flashtier.kvstore.config import KVStoreConfig
from flashtier.kvstore.snapshot.pool import EmbeddedSnapshotPool

from .conftest import random_prompt
from .restore_bytes_oracle import use_bytes_path

BS = 16
PARAMS = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=3)


def turn(engine: Engine, rid: str, prompt: list[int]):
    """(tokens, logprobs, cache usage, resume kind) of one request run to the end."""
    engine.add_request(rid, prompt, PARAMS)
    tokens, logprobs, last = [], [], None
    for _ in range(10_000):
        if not engine.has_unfinished():
            break
        for out in engine.step():
            for c in out.choices:
                tokens += c.token_ids
                logprobs += [(lp.logprob, lp.top) for lp in c.logprobs or ()]
            last = out
        if engine.scheduler.loading:
            time.sleep(0.002)  # a tier lookup is in flight on the I/O thread
    return tokens, logprobs, last.cache, last.resume.kind


def resumed(model, tmp_path, *, snapshots: bool):
    cfg = KVStoreConfig(block_size=BS, num_blocks=64, ssd_dir=str(tmp_path))
    engine = Engine(model, EngineConfig(max_num_batched_tokens=256), cfg, TierManager(cfg))
    a = random_prompt(70, seed=41)
    tokens, *_ = turn(engine, "a", a)
    engine.tiers.writer.flush(timeout=10)
    for fut in list(engine.tiers._pending):
        fut.result(timeout=10)
    assert engine.pool.reset_prefix_cache()  # B's full blocks must come from the SSD
    if not snapshots:
        engine.tiers.snapshots = EmbeddedSnapshotPool(ttl_s=60, budget_bytes=1 << 30)
    got = turn(engine, "b", a + tokens + random_prompt(20, seed=50))
    data = engine.kvm.kv.data.clone()
    restore = engine.tiers.restore
    engine.close()
    return got, data, restore


@pytest.mark.parametrize("snapshots,kind", [(True, "exact"), (False, "replay")])
def test_a_restore_through_the_buffer_is_bit_identical_to_the_bytes_path(tiny64, tmp_path, monkeypatch,
                                                                          snapshots, kind):
    (tokens, logprobs, cache, got_kind), data, restore = resumed(tiny64, tmp_path / "buffer", snapshots=snapshots)
    assert got_kind == kind and cache.ssd_tokens == 4 * BS  # blocks 0..3 (of 75 fed tokens) came from the SSD
    assert restore.stats.acquired >= 1 and restore.held == 0  # read into the buffer, given back at install
    with monkeypatch.context() as patch:
        use_bytes_path(patch)
        (want_tokens, want_logprobs, want_cache, _), want_data, unused = resumed(tiny64, tmp_path / "bytes",
                                                                                 snapshots=snapshots)
    assert unused.stats.acquired == 0  # the oracle really read bytes
    assert cache == want_cache and tokens == want_tokens
    assert logprobs == want_logprobs  # floats compared exactly
    assert torch.equal(data, want_data)
