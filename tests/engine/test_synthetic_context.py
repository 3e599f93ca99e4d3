"""Synthetic long contexts (benchmarks/synthetic_context.py) checked against the engine's two forward paths.

The oracle: two engines on the same float64 tiny model, one with the batched forward (window read by ring-slot
arithmetic, entries chosen by the indexer op and attended by the sparse-MQA op over the packed pool) and one with
the per-sequence forward (window masked by the rings' stored positions, entries dequantised per sequence, the
entry count asserted against the visible entries), prefilled from the same prompts and extended with the same
seed. Decode steps must give logits that agree to 1e-9 relative (test_batched_forward's bound: the paths sum in
different orders; here they measured 0.0) and the same tokens. State that disagrees with its bytes reads
differently on the two paths, and the tests below show such states are caught (window positions off by one:
1.2 relative error), and that the step really reads the synthetic entries.
"""

import pytest
import torch

from synthetic_context import SyntheticContext, check_context
from flashtier.engine.config import EngineConfig
from flashtier.engine.engine import Engine
from flashtier.engine.sample.params import SamplingParams
from flashtier.kernels.quant.fp4 import pack_fp4_record, quantize_fp4
from flashtier.kernels.quant.mxfp4 import pack_mxfp4_record, quantize_mxfp4
from flashtier.kvstore.block_hash import hash_blocks
from flashtier.kvstore.config import KVStoreConfig

from .conftest import random_prompt

TOL = 1e-9
BLOCK = 16
PROMPTS = (5, 9, 2)
CONTEXTS = (301, 256, 777)  # odd (open ratio-2 groups), block-aligned (the step needs a new block), ragged
WANT = {f"r{i}": n for i, n in enumerate(CONTEXTS)}


def _engine(model, forward, blocks=200):
    cfg = EngineConfig(forward=forward, dtype="float64", max_num_seqs=4, max_num_batched_tokens=64)
    engine = Engine(model, cfg, KVStoreConfig(block_size=BLOCK, num_blocks=blocks))
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    for i, n in enumerate(PROMPTS):
        engine.add_request(f"r{i}", random_prompt(n, seed=40 + i), params)
    engine.step()  # prefill + replay: every request decodes after its first token
    return engine


def _record(engine):
    seen = []
    execute = engine.runner.execute

    def wrapped(batch):
        out = execute(batch)
        seen.append(out.logits.clone())
        return out

    engine.runner.execute = wrapped
    return seen


def _extended(model, forward, *, distinct=None, blocks=200):
    engine = _engine(model, forward, blocks)
    synth = SyntheticContext(engine, seed=3, distinct=distinct)
    for i, n in enumerate(CONTEXTS):
        synth.extend(f"r{i}", n)
    return engine


def _tokens(engine):
    return [list(r.seqs[0].output) for r in engine.requests.values()]


def test_decode_over_synthetic_context_matches_the_per_sequence_forward(tiny64):
    bat, ref = _extended(tiny64, "batched"), _extended(tiny64, "per-sequence")
    for engine in (bat, ref):
        check_context(engine, WANT)
        for i in range(len(CONTEXTS)):
            req = engine.requests[f"r{i}"]
            assert req.seqs[0].hashes == hash_blocks(req.namespace, req.prompt, BLOCK)  # the postprocessor's chain
    got, want = _record(bat), _record(ref)
    for _ in range(2):  # the first step closes the open groups and takes the new block
        bat.step()
        ref.step()
        bat.check_integrity()
        ref.check_integrity()
    assert bat.runner.per_sequence_steps == 0, "a step fell back to the per-sequence forward"
    for a, b in zip(got, want):
        assert a.shape == (len(CONTEXTS), tiny64.cfg.vocab_size) and torch.isfinite(a).all()
        assert float((a - b).abs().max() / b.abs().max()) < TOL
    assert _tokens(bat) == _tokens(ref)
    assert [len(r.seqs[0].kv.tokens) for r in bat.requests.values()] == [n + 2 for n in CONTEXTS]


def test_a_wrong_entry_count_is_caught(tiny64):
    engine = _extended(tiny64, "per-sequence")
    store = engine.requests["r1"].seqs[0].kv.stores[tiny64.cfg.decoder_source]
    store.count -= 1
    with pytest.raises(RuntimeError, match="entries"):
        check_context(engine, WANT)
    with pytest.raises(AssertionError):  # the forward refuses to read or append past a short count
        engine.step()
    engine = _extended(tiny64, "per-sequence")
    store = engine.requests["r0"].seqs[0].kv.stores[8]
    store.count += 1  # claims an entry that was never written
    with pytest.raises(RuntimeError, match="entries"):
        check_context(engine, WANT)


def test_an_unwritten_entry_below_the_count_is_caught(tiny64):
    engine = _extended(tiny64, "batched")
    kv = engine.requests["r2"].seqs[0].kv
    store = kv.stores[2]
    j = store.count - 1
    engine.kvm.kv.streams[store.stream][0][kv.table.ids[j // store.per_block], j % store.per_block] = 0
    with pytest.raises(RuntimeError, match="unwritten entry"):
        check_context(engine, WANT)


def test_window_positions_off_by_one_change_the_logits(tiny64):
    """The oracle can fail: rings whose positions disagree with their slots read differently on the two paths."""
    bat, ref = _extended(tiny64, "batched"), _extended(tiny64, "per-sequence")
    pos = ref.requests["r0"].seqs[0].kv.rings.pos
    pos[pos >= 0] -= 1
    with pytest.raises(RuntimeError, match="window ring positions"):
        check_context(ref, WANT)
    got, want = _record(bat), _record(ref)
    bat.step()
    ref.step()
    err = (got[0] - want[0]).abs().amax(-1) / want[0].abs().amax(-1)
    assert err[0] > 1e-6 and float(err[1:].max()) < TOL


def test_the_step_reads_the_synthetic_entries(tiny64):
    """New random records in r0's synthetic S20 entries (rings untouched) change r0's logits and no one else's."""
    same, changed = _extended(tiny64, "batched"), _extended(tiny64, "batched")
    kv = changed.requests["r0"].seqs[0].kv
    store = kv.stores[tiny64.cfg.decoder_source]
    j = torch.arange(PROMPTS[0], store.count)
    g = torch.Generator().manual_seed(9)
    main = pack_fp4_record(*quantize_fp4(torch.randn(j.numel(), store.head_dim, generator=g)))
    index = pack_mxfp4_record(*quantize_mxfp4(torch.randn(j.numel(), store.index_dim, generator=g)))
    changed.kvm.kv.write(store.stream, kv.table.tensor()[j // store.per_block], j % store.per_block, main, index)
    check_context(changed, WANT)
    got, want = _record(changed), _record(same)
    changed.step()
    same.step()
    err = (got[0] - want[0]).abs().amax(-1) / want[0].abs().amax(-1)
    assert err[0] > 1e-3 and float(err[1:].max()) < TOL


def test_tiled_entries_give_a_valid_state(tiny64):
    engine = _extended(tiny64, "batched", distinct=5)
    check_context(engine, WANT)
    logits = _record(engine)
    engine.step()
    engine.check_integrity()
    assert torch.isfinite(logits[0]).all()


def test_bad_requests_and_a_short_pool_are_refused(tiny64):
    engine = _engine(tiny64, "batched", blocks=30)
    synth = SyntheticContext(engine, seed=0)
    with pytest.raises(ValueError, match="context"):
        synth.extend("r0", PROMPTS[0])
    with pytest.raises(ValueError, match="request_id"):
        synth.extend("nope", 100)
    with pytest.raises(ValueError, match="distinct"):
        SyntheticContext(engine, distinct=0)
    kv = engine.requests["r0"].seqs[0].kv
    before = (len(kv.table), len(kv.tokens), engine.kvm.num_free)
    with pytest.raises(RuntimeError, match="free blocks"):
        synth.extend("r0", 30 * BLOCK)
    assert (len(kv.table), len(kv.tokens), engine.kvm.num_free) == before
    synth.extend("r0", 100)
    engine.step()  # r0 now holds 101 tokens; a second extension is refused (it is past its first token)
    with pytest.raises(ValueError, match="first token"):
        synth.extend("r0", 200)
