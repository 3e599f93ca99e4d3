"""The drafter's graph path (engine/spec/draft_graphs.py) against its eager proposal, on the CPU.

Without CUDA the graph object runs its padded static program eagerly (``capture=False``): the same buffers, pad
rows and buckets a capture records. Two speculative engines on the same float64 tiny model (with its drafter
stages) run the same 10 greedy requests with the real drafter, 3 drafts every step: one proposes eagerly, one
through the padded program (batches of 10, then fewer as requests finish, padded to buckets 16, 8, 4, ...). Every
proposal's drafts must be equal and their confidences agree to 1e-5 relative (only the row count of each op
differs; the confidence head computes in fp32 whatever the model's precision: measured 3e-7); the tokens must be
equal to plain decoding's. Sampled requests beside greedy ones: the noise drawn before the replay from each
request's generator, in the eager loop's order, gives the eager drafts, q and tokens. A Markov loop that drops
the Markov bias must fail the comparison.
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
    """Seeded sampled requests (and greedy ones beside them) through the graph path: the same noise from the same
    generators in the same order, so the same drafts, the same q (1e-6: fp32 softmax over another row count) and
    the same tokens (the drafts' draws and the acceptance rule's share each request's generator: equal tokens
need equal consumption)."""
    reqs = [(rid, prompt, SamplingParams(temperature=0.7 + 0.1 * i, seed=11 + i, max_tokens=8, ignore_eos=True))
            for i, (rid, prompt, _) in enumerate(REQUESTS[:5])] + REQUESTS[5:8]
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
    want, got = run(ref, reqs), run(padded, reqs)
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


def test_a_loop_without_the_markov_bias_is_caught(model, monkeypatch):
    ref, bad = _engine(model, False), _engine(model, True)
    ref_p, bad_p = _proposals(ref), _proposals(bad)

    real = draft_graphs.markov
    no_bias_fn = lambda m, t: (torch.zeros_like(real(m, t)[0]), real(m, t)[1])  # noqa: E731
    monkeypatch.setattr(draft_graphs, "markov", no_bias_fn)
    run(ref, REQUESTS[:4]), run(bad, REQUESTS[:4])
    first_ref, first_bad = ref_p[0], bad_p[0]
    assert [d for d, _ in first_ref] != [d for d, _ in first_bad] or any(
        not torch.allclose(ca, cb, rtol=1e-6) for (_, ca), (_, cb) in zip(first_ref, first_bad))
