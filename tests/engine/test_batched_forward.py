"""The batched forward (ring arena + the kernels' ops over all rows) against the per-sequence forward.

Two engines on the same float64 tiny model run the same requests with the same schedule: one with
``forward="per-sequence"`` (attention per sequence in plain torch), one with ``forward="batched"`` (on the
CPU the kernels dispatch to their plain-torch references). Every step's logits must agree to 1e-9
relative (the paths sum in different orders; a selection difference would show as O(1)), and the sampled
tokens must be identical. Mixed steps: chunked prefills, decodes, bounded replays and preemption.
"""

import pytest
import torch

from flashtier.engine.config import EngineConfig
from flashtier.engine.engine import Engine
from flashtier.engine.sample.params import SamplingParams
from flashtier.kvstore.config import KVStoreConfig

from .conftest import random_prompt
from .logit_recorder import record_logits

TOL = 1e-9


def _engine(model, forward, *, budget=96, blocks=400, max_seqs=16):
    cfg = EngineConfig(max_num_batched_tokens=budget, max_num_seqs=max_seqs, forward=forward, dtype="float64")
    return Engine(model, cfg, KVStoreConfig(block_size=16, num_blocks=blocks))


def _run(engine, requests):
    for rid, prompt, params in requests:
        engine.add_request(rid, prompt, params)
    out = {}
    while engine.has_unfinished():
        for o in engine.step():
            for c in o.choices:
                out.setdefault((o.request_id, c.index), []).extend(c.token_ids)
        engine.check_integrity()
    return out


def _compare(model, requests, **kw):
    ref, bat = _engine(model, "per-sequence", **kw), _engine(model, "batched", **kw)
    ref_logits, bat_logits = record_logits(ref), record_logits(bat)
    want, got = _run(ref, requests), _run(bat, requests)
    assert bat.runner.per_sequence_steps == 0, "a step fell back to the per-sequence forward"
    assert len(ref_logits) == len(bat_logits)
    worst = 0.0
    for a, b in zip(ref_logits, bat_logits):
        assert (a is None) == (b is None)
        if a is not None:
            worst = max(worst, float((a - b).abs().max() / a.abs().max()))
    assert worst < TOL, f"batched logits differ from per-sequence ones by {worst:.3g} (relative)"
    assert got == want
    return worst


def _greedy(n):
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def test_mixed_prefill_and_decode_batch(tiny64):
    lengths = [3, 17, 40, 1, 33]
    reqs = [(f"r{i}", random_prompt(n, seed=100 + i), _greedy(5)) for i, n in enumerate(lengths)]
    _compare(tiny64, reqs)


def test_long_contexts_select_entries(tiny64):
    # > index_topk * ratio positions: the indexer chooses, the candidate pool bites (tiny: top-8, 4 blocks of 8)
    reqs = [(f"r{i}", random_prompt(n, seed=200 + i), _greedy(3)) for i, n in enumerate([150, 97])]
    _compare(tiny64, reqs, budget=128)


def test_prefix_hit_bounded_replay(tiny64):
    base = random_prompt(120, seed=300)
    first = [("a", base, _greedy(4))]
    second = [("b", base + random_prompt(20, seed=301), _greedy(6)), ("c", base[:70] + [5, 6, 7], _greedy(5))]
    ref, bat = _engine(tiny64, "per-sequence"), _engine(tiny64, "batched")
    for eng in (ref, bat):
        _run(eng, first)
    ref_logits, bat_logits = record_logits(ref), record_logits(bat)
    assert _run(bat, second) == _run(ref, second)
    assert ref.scheduler.stats.prefix_hits_tokens > 0
    for a, b in zip(ref_logits, bat_logits):
        if a is not None:
            assert float((a - b).abs().max() / a.abs().max()) < TOL


def test_detects_a_broken_window(tiny64, monkeypatch):
    """The comparison can fail: a batched forward that drops the oldest window key is caught."""
    from flashtier.engine.runner import step_metadata

    real = step_metadata.build_step_rows

    def broken(*a, **k):
        rows = real(*a, **k)
        count = (rows.win_count - 1).clamp(min=1)
        return type(rows)(**{**rows.__dict__, "win_count": count, "win_start": rows.win_start + (rows.win_count - count)})

    monkeypatch.setattr("flashtier.engine.runner.paged_runner.build_step_rows", broken)
    reqs = [("a", random_prompt(40, seed=7), _greedy(5))]
    with pytest.raises(AssertionError, match="differ|=="):
        _compare(tiny64, reqs)
