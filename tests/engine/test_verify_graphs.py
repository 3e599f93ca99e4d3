"""Speculative steps through the decode-graph path (engine/runner/decode_graphs.py) against the eager batched
forward, on the CPU.

Without CUDA the graph object runs its padded static program eagerly (``capture=False``): the same buffers, pad
rows and buckets a capture records. Two speculative engines on the same float64 tiny model (with its drafter
stages) run the same 12 greedy requests (14 tokens each), a quarter of them kept on plain decoding (steps mix
VERIFY chunks and DECODE rows): one eager, one whose decode-shaped steps (plain decodes and verified chunks) go through the padded
path with the draft-input taps. Drafts come from a drafter forced to propose the target's own continuation,
wrong from a varying position on (every acceptance length, rollbacks), or from the real drafter (nearly always
rejected). Per step, the logits and the draft inputs must agree to 1e-12 relative (only the row count of each
op differs); the tokens must be identical; at the end every real ring slot and every real block's entries must
be equal byte for byte. Verified chunks that start at an odd position pair their first row with the group the
sequence opened before, and chunks of more than one row pair rows inside the step (``DenseWrites.partner``): a
path that drops the in-step partner must fail.
"""

from __future__ import annotations

import pytest
import torch

from flashtier.engine.core.scheduler_output import DecoderKind
from flashtier.engine.model.init import random_model
from flashtier.engine.runner import decode_step
from flashtier.engine.runner.decode_graphs import DecodeGraphs
from flashtier.engine.sample.params import SamplingParams

from .conftest import random_prompt
from .spec_harness import GREEDY, force_drafts, make, plain_quarter, run

TOL = 1e-12
REQUESTS = [(f"r{i}", random_prompt(4 + (7 * i) % 17, seed=700 + i), SamplingParams(**{**GREEDY, "max_tokens": 14}))
            for i in range(12)]


@pytest.fixture(scope="module")
def model(tiny_cfg):
    return random_model(tiny_cfg, seed=1, dtype=torch.float64, with_dspark=True)


@pytest.fixture(scope="module")
def plain(model):
    return run(make(model, spec=0), REQUESTS)


def _record(engine) -> list[tuple[torch.Tensor | None, torch.Tensor | None, bool]]:
    """Each step's (logits, draft inputs, whether it had VERIFY work)."""
    seen = []
    execute = engine.runner.execute

    def wrapped(batch):
        out = execute(batch)
        verify = any(w.kind is DecoderKind.VERIFY for w in batch.decoder)
        seen.append((None if out.logits is None else out.logits.clone(),
                     None if out.hidden is None else out.hidden.clone(), verify))
        return out

    engine.runner.execute = wrapped
    return seen


def _engine(model, plain, *, graphs: bool, forced: bool):
    eng = make(model)
    plain_quarter(eng)
    if forced:
        force_drafts(eng, plain)
    if graphs:
        paged = eng.runner.paged
        paged.graphs = DecodeGraphs(model, paged.views, eng.kvm.arena.pad_slot, paged.sources, capture=False,
                                    max_rows=64)
    return eng


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / a.abs().max().clamp_min(1e-300))


def _compare(ref_steps, got_steps) -> float:
    assert len(ref_steps) == len(got_steps)
    worst = 0.0
    for (lr, hr, vr), (lg, hg, vg) in zip(ref_steps, got_steps):
        assert vr == vg and (lr is None) == (lg is None) and (hr is None) == (hg is None)
        if lr is not None:
            assert lr.shape == lg.shape
            worst = max(worst, _rel(lr, lg))
        if hr is not None:
            assert hr.shape == hg.shape
            worst = max(worst, _rel(hr, hg))
    return worst


def _graph_verify_steps(eng) -> list[int]:
    """Rows of each graph step that ran verified chunks (wraps the graphs' run)."""
    graphs, seen = eng.runner.paged.graphs, []
    run_ = graphs.run

    def wrapped(step, taps=()):
        if step.num_rows > len(step.seqs):
            assert taps, "a verified chunk without its draft inputs"
            seen.append(step.num_rows)
        return run_(step, taps)

    graphs.run = wrapped
    return seen


@pytest.mark.parametrize("forced", [True, False], ids=["forced_drafts", "real_drafter"])
def test_verify_steps_through_the_padded_path_match_eager(model, plain, forced):
    ref, padded = _engine(model, plain, graphs=False, forced=forced), _engine(model, plain, graphs=True,
                                                                               forced=forced)
    ref_steps, pad_steps = _record(ref), _record(padded)
    chunks = _graph_verify_steps(padded)
    want, got = run(ref, REQUESTS), run(padded, REQUESTS)
    assert want == got == plain
    worst = _compare(ref_steps, pad_steps)
    assert worst < TOL, f"padded verify steps differ by {worst:.3g}"
    assert len(chunks) >= 5 and max(chunks) > 12, chunks  # verified chunks, several per step, went through it
    s = padded.stats()
    if forced:
        assert all(n > 0 for n in s.spec_acceptance_lengths), s.spec_acceptance_lengths
    arena_r, arena_p = ref.kvm.arena, padded.kvm.arena
    live = slice(0, arena_p.pad_slot * arena_p.window)
    assert torch.equal(arena_r.data[:, live], arena_p.data[:, live])
    assert torch.equal(arena_r.pos[:, live], arena_p.pos[:, live])
    views_r, views_p = ref.runner.paged.views, padded.runner.paged.views
    for src in views_r.main:  # every entry of every real block (block 0 is the null block pad rows write to)
        assert torch.equal(views_r.main[src][1:], views_p.main[src][1:]), src
        assert torch.equal(views_r.index[src][1:], views_p.index[src][1:]), src


def test_a_chunk_without_its_in_step_partner_is_caught(model, plain, monkeypatch):
    """Pairing a chunk's odd rows with the waiting group instead of the row before (partner dropped) changes the
    ratio-2 entries, so the logits."""
    dense = decode_step._dense

    def no_partner(*args, **kwargs):
        w, counts = dense(*args, **kwargs)
        if w.partner is not None:
            w = type(w)(w.block, w.offset, w.entry_pos, w.waiting_kv, w.waiting_z, torch.full_like(w.partner, -1))
        return w, counts

    monkeypatch.setattr(decode_step, "_dense", no_partner)
    ref, bad = _engine(model, plain, graphs=False, forced=True), _engine(model, plain, graphs=True, forced=True)
    ref_steps, bad_steps = _record(ref), _record(bad)
    run(ref, REQUESTS[:6]), run(bad, REQUESTS[:6])
    worst = max((_rel(a[0], b[0]) for a, b in zip(ref_steps, bad_steps) if a[0] is not None
                 and b[0] is not None and a[0].shape == b[0].shape), default=0.0)
    assert worst > 1e-6


def test_each_set_keeps_its_own_buckets(model, monkeypatch):
    """The plain and verify sets evict their least recently used buckets separately: verify churn never drops a
    plain decode graph (nor the reverse)."""
    import flashtier.engine.runner.decode_graphs as dg

    monkeypatch.setattr(dg, "MAX_GRAPHS", 2)
    eng = make(model)
    paged, taps = eng.runner.paged, eng.runner.taps
    graphs = DecodeGraphs(model, paged.views, eng.kvm.arena.pad_slot, paged.sources, capture=False, max_rows=8)
    assert graphs.prepare(1) and graphs.prepare(2)
    for rows in (1, 2, 4, 8):
        assert graphs.prepare(rows, taps)
    keys = list(graphs._buckets)
    assert [k for k in keys if not k[2]] == [(1, 16, ()), (2, 16, ())]
    assert [k for k in keys if k[2]] == [(4, 16, taps), (8, 16, taps)]
    assert graphs.prepare(4) and (1, 16, ()) not in graphs._buckets and (4, 16, taps) in graphs._buckets
