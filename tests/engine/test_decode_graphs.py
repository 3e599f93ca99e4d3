"""The decode-graph path's padding (engine/runner/decode_graphs.py) against the unpadded batched forward, on the CPU.

Without CUDA the graph object runs its padded static path eagerly (``capture=False``): the same buffers, the
same pad rows and bucket choice a capture would record. Two engines on the same float64 tiny model run the same
requests: one plain batched, one whose plain decode steps go through the padded path (batches of 3, 5, ...
padded to buckets 4, 8, ...), encoder and decoder with the entry writes in their dense form
(engine/runner/decode_step.py). Logits must agree to 1e-12 relative (only the row count of each op differs), tokens
must be identical, and every real slot's rings and every real block's entries must be equal byte for byte at
the end; the pad rows must have written their rings to the pad slot only. With the pad slot pointed at a live slot the same run
must fail (a sequence's rings overwritten by pad rows).
"""

import copy

import pytest
import torch

from flashtier.engine.config import EngineConfig
from flashtier.engine.runner.decode_graphs import DecodeGraphs, bucket_size, table_bucket
from flashtier.engine.engine import Engine
from flashtier.engine.model.engram_offload import tables_to_host_
from flashtier.engine.sample.params import SamplingParams
from flashtier.kvstore.config import KVStoreConfig

from .conftest import random_prompt
from .logit_recorder import record_logits

TOL = 1e-12
LENGTHS = [3, 17, 40, 1, 33]  # 5 sequences: decode batches of 5 pad to 8, of 3 (after finishes) to 4


def _engine(model, *, pad_slot=None):
    cfg = EngineConfig(max_num_batched_tokens=96, max_num_seqs=8, forward="batched", dtype="float64")
    eng = Engine(model, cfg, KVStoreConfig(block_size=16, num_blocks=400))
    if pad_slot is not None:
        paged = eng.runner.paged
        slot = eng.kvm.arena.pad_slot if pad_slot == "pad" else pad_slot
        paged.graphs = DecodeGraphs(model, paged.views, slot, paged.sources, capture=False, max_rows=8)
    return eng


def _run(eng, logits):
    record_logits(eng, logits)
    for i, n in enumerate(LENGTHS):
        eng.add_request(f"r{i}", random_prompt(n, seed=300 + i),
                        SamplingParams(temperature=0, max_tokens=4 + 3 * (i % 3), ignore_eos=True))
    out = {}
    while eng.has_unfinished():
        for o in eng.step():
            out.setdefault(o.request_id, []).extend(o.choices[0].token_ids)
        eng.check_integrity()
    return out


def _worst(a_list, b_list):
    worst = 0.0
    assert len(a_list) == len(b_list)
    for a, b in zip(a_list, b_list):
        assert (a is None) == (b is None)
        if a is not None:
            worst = max(worst, float((a - b).abs().max() / a.abs().max()))
    return worst


def test_buckets():
    sizes = (1, 2, 4, 8)
    assert [bucket_size(n, sizes) for n in (1, 2, 3, 5, 8, 9)] == [1, 2, 4, 8, 8, None]
    assert [table_bucket(m) for m in (1, 16, 17, 100)] == [16, 16, 32, 128]


@pytest.fixture(scope="module")
def tiny64_host_engram(tiny64):
    model = copy.deepcopy(tiny64)
    tables_to_host_(model, "cpu")
    return model


@pytest.mark.parametrize("engram", ["device", "host"])
def test_padded_decode_matches_unpadded(tiny64, tiny64_host_engram, engram):
    model = tiny64 if engram == "device" else tiny64_host_engram
    ref_logits, pad_logits = [], []
    ref, padded = _engine(model), _engine(model, pad_slot="pad")
    want, got = _run(ref, ref_logits), _run(padded, pad_logits)
    worst = _worst(ref_logits, pad_logits)
    assert worst < TOL, f"padded decode logits differ by {worst:.3g}"
    assert padded.runner.paged.graphs.runs >= 8, "the padded path was not taken"
    if engram == "host":  # the feed carried the rows: no on-demand gather in the padded program
        host = next(b.engram.host for b in model.layers if b.engram is not None)
        assert host.on_demand == 0 and host.feed is None
    assert got == want
    arena_r, arena_p = ref.kvm.arena, padded.kvm.arena
    live = slice(0, arena_p.pad_slot * arena_p.window)  # every slot but the pad slot
    assert torch.equal(arena_r.data[:, live], arena_p.data[:, live])
    assert torch.equal(arena_r.pos[:, live], arena_p.pos[:, live])
    pad_rows = arena_p.rows(arena_p.pad_slot)
    assert (arena_p.pos[:, pad_rows] == 0).any(dim=1).all(), "a layer wrote no pad row (no batch was padded?)"
    assert (arena_r.pos[:, arena_r.rows(arena_r.pad_slot)] == -1).all()
    views_r, views_p = ref.runner.paged.views, padded.runner.paged.views
    for src in views_r.main:  # every entry of every real block (block 0 is the null block pad rows write to)
        assert torch.equal(views_r.main[src][1:], views_p.main[src][1:]), src
        assert torch.equal(views_r.index[src][1:], views_p.index[src][1:]), src


def test_pad_rows_into_a_live_slot_are_caught(tiny64):
    ref_logits, bad_logits = [], []
    ref, bad = _engine(tiny64), _engine(tiny64, pad_slot=0)
    _run(ref, ref_logits), _run(bad, bad_logits)
    assert _worst(ref_logits, bad_logits) > 1e-6


def test_least_recently_used_buckets_are_dropped(tiny64, monkeypatch):
    import flashtier.engine.runner.decode_graphs as dg

    monkeypatch.setattr(dg, "MAX_GRAPHS", 1)
    ref_logits, pad_logits = [], []
    ref, padded = _engine(tiny64), _engine(tiny64, pad_slot="pad")
    want, got = _run(ref, ref_logits), _run(padded, pad_logits)
    graphs = padded.runner.paged.graphs
    assert len(graphs._buckets) == 1 and graphs.runs >= 8  # batches of 5 and 3: two buckets, one kept at a time
    assert _worst(ref_logits, pad_logits) < TOL and got == want
