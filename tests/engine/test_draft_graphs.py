"""The drafter's graph path (engine/spec/draft_graphs.py) against its unpadded program, on the CPU.

Without CUDA the graph object runs its padded static program eagerly (``capture=False``): the same buffers, pad
rows and buckets a capture records. Two speculative engines on the same float64 tiny model (with its drafter
stages) run the same 10 greedy requests with the real drafter, 3 drafts every step: one proposes eagerly, one
through the padded program (batches of 10, then fewer as requests finish, padded to buckets 16, 8, 4, ...). Every
proposal's drafts must be equal and their confidences agree to 1e-5 relative (only the row count of each op
differs; the confidence head computes in fp32 whatever the model's precision: measured 3e-7); the tokens must be
equal to plain decoding's. Sampled requests beside greedy ones: the noise drawn from each request's generator
before the program runs, padded or not, gives the same drafts, q and tokens (that the drafts follow q, and the
tokens the target distribution, is test_speculative.py's chi-square). A graph program that drops the Markov bias
must fail the comparison.
"""

from __future__ import annotations

import pytest
import torch

from flashtier.engine.model.init import random_model
from flashtier.engine.sample.params import SamplingParams
from flashtier.engine.spec import draft_graphs
from flashtier.engine.spec.draft_graphs import DraftGraphs

from .conftest import random_prompt
from .spec_harness import DEPTH, GREEDY, make, run

TOL = 1e-5  # the confidence head runs in fp32 (as the official one) even on a float64 model: fp32 summation order
REQUESTS = [(f"r{i}", random_prompt(5 + (11 * i) % 23, seed=400 + i),
             SamplingParams(**{**GREEDY, "max_tokens": 6 + i % 4})) for i in range(10)]


@pytest.fixture(scope="module")
def model(tiny_cfg):
    return random_model(tiny_cfg, seed=2, dtype=torch.float64, with_dspark=True)


@pytest.fixture(scope="module")
def plain(model):
    return run(make(model, spec=0), REQUESTS)


def _proposals(engine, rids: list | None = None) -> list[list[tuple[tuple[int, ...], torch.Tensor]]]:
    """Each proposal's (drafts, confidence) per sequence, in order (wraps the drafter's propose); ``rids`` gets
    each proposal's request ids."""
    seen = []
    propose = engine.drafter.propose

    def wrapped(live, n):
        propose(live, n)
        seen.append([(s.spec.drafts, s.spec.confidence.clone()) for _, s in live])
        if rids is not None:
            rids.append({r.request_id for r, _ in live})

    engine.drafter.propose = wrapped
    return seen


def _engine(model, graphs: bool):
    eng = make(model)
    if graphs:
        eng.drafter.graphs = DraftGraphs(model, (1, 2, 4, 8, 16), DEPTH, capture=False)
    return eng


def _worst(ref, got) -> float:
    assert len(ref) == len(got) and ref
    worst = 0.0
    for a, b in zip(ref, got):
        assert [d for d, _ in a] == [d for d, _ in b]
        for (_, ca), (_, cb) in zip(a, b):
            worst = max(worst, float((ca - cb).abs().max() / ca.abs().max().clamp_min(1e-300)))
    return worst


def test_padded_proposals_match_eager(model, plain):
    ref, padded = _engine(model, False), _engine(model, True)
    ref_p, pad_p = _proposals(ref), _proposals(padded)
    assert run(ref, REQUESTS) == plain and run(padded, REQUESTS) == plain
    assert _worst(ref_p, pad_p) < TOL
    g = padded.drafter.graphs
    assert g.runs == len(pad_p) >= 5 and set(g._buckets) >= {16, 8}, (g.runs, list(g._buckets))


def test_sampled_proposals_match_eager(model):
    """Seeded sampled requests (and greedy ones beside them) through the graph path and unpadded: the same noise
    from the same generators, so the same drafts, the same q (1e-6: fp32 softmax over another row count) and the
    same tokens (the drafts' draws and the acceptance rule's share each request's generator: equal tokens need
    equal consumption)."""
    reqs = [(rid, prompt, SamplingParams(temperature=0.7 + 0.1 * i, seed=11 + i if i < 3 else None, max_tokens=8,
                                         ignore_eos=True))
            for i, (rid, prompt, _) in enumerate(REQUESTS[:5])] + REQUESTS[5:8]  # 3 seeded, 2 on the default RNG
    qs = {}

    def engine(graphs):
        eng = _engine(model, graphs)
        seen = qs.setdefault(graphs, [])
        propose = eng.drafter.propose

        def wrapped(live, n):
            propose(live, n)
            seen.append([None if s.spec.q is None else s.spec.q.clone() for _, s in live])

        eng.drafter.propose = wrapped
        return eng

    ref, padded = engine(False), engine(True)
    ref_p, pad_p = _proposals(ref), _proposals(padded)
    torch.manual_seed(5)  # the unseeded rows' draws: the same default-generator state for both runs
    want = run(ref, reqs)
    torch.manual_seed(5)
    got = run(padded, reqs)
    assert got == want
    assert _worst(ref_p, pad_p) < TOL
    assert padded.drafter.graphs.runs == len(pad_p)
    n_q = 0
    for a, b in zip(qs[False], qs[True]):
        for qa, qb in zip(a, b):
            assert (qa is None) == (qb is None)
            if qa is not None:
                assert qa.shape == qb.shape and float((qa - qb).abs().max()) <= 1e-6
                n_q += 1
    assert n_q >= 10


def test_a_graph_program_without_the_markov_bias_is_caught(model):
    ref, bad = _engine(model, False), _engine(model, True)
    ref_p, bad_p = _proposals(ref), _proposals(bad)

    def no_bias(bucket, k, sampled):
        x = draft_graphs.draft_rows(model, bucket.ring_kv, bucket.ring_pos, bucket.last, bucket.positions)
        tokens, conf = [bucket.last], []
        for i in range(k):
            _, me = draft_graphs.markov(model, tokens[i])
            conf.append(draft_graphs.confidence(model, x[:, i], me))
            tokens.append(draft_graphs.head_logits(model, x[:, i]).float().argmax(dim=-1))
        return draft_graphs.DraftOutputs(torch.stack(tokens[1:], dim=1), torch.stack(conf, dim=1))

    bad.drafter.graphs._program = no_bias
    run(ref, REQUESTS[:4]), run(bad, REQUESTS[:4])
    first_ref, first_bad = ref_p[0], bad_p[0]
    assert [d for d, _ in first_ref] != [d for d, _ in first_bad] or any(
        not torch.allclose(ca, cb, rtol=1e-6) for (_, ca), (_, cb) in zip(first_ref, first_bad))


def test_prepare_makes_the_sampled_buffers(model):
    """The warm-up's ``prepare(..., sampled=True)`` makes a bucket's noise and q buffers (what the memory plan
    counts) up front; without CUDA nothing is captured, so it reports no graph made."""
    graphs = DraftGraphs(model, (1, 2, 4), DEPTH, capture=False)
    assert graphs.prepare(3, 2) is False and graphs._buckets[4].noise is None
    assert graphs.prepare(3, 2, sampled=True) is False
    bucket = graphs._buckets[4]
    assert bucket.noise.shape == bucket.q.shape == (4, DEPTH, model.cfg.vocab_size)
    assert not bool(bucket.sampled.any()) and bool((bucket.temperature == 1).all())
    assert graphs.prepare(5, 1) is False and set(graphs._buckets) == {4}  # past the largest bucket: nothing
