"""The drafter's graph path (engine/spec/draft_graphs.py) against its eager proposal, on the CPU.

Without CUDA the graph object runs its padded static program eagerly (``capture=False``): the same buffers, pad
rows and buckets a capture records. Two speculative engines on the same float64 tiny model (with its drafter
stages) run the same 10 greedy requests with the real drafter, 3 drafts every step: one proposes eagerly, one
through the padded program (batches of 10, then fewer as requests finish, padded to buckets 16, 8, 4, ...). Every
proposal's drafts must be equal and their confidences agree to 1e-5 relative (only the row count of each op
differs; the confidence head computes in fp32 whatever the model's precision: measured 3e-7); the tokens must be equal to plain decoding's. A batch with a sampled request proposes eagerly (the
draws need each request's generator). A Markov loop that drops the Markov bias must fail the comparison.
"""

from __future__ import annotations

import pytest
import torch

from flashtier.engine.model.init import random_model
from flashtier.engine.sample.params import SamplingParams
from flashtier.engine.spec import draft_graphs
from flashtier.engine.spec.draft_graphs import DraftGraphs

from .conftest import random_prompt
from .spec_harness import GREEDY, make, run

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
        eng.drafter.graphs = DraftGraphs(model, (1, 2, 4, 8, 16), capture=False)
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


def test_a_sampled_request_proposes_eagerly(model):
    eng = _engine(model, True)
    reqs = REQUESTS[:3] + [("s9", random_prompt(9, seed=9), SamplingParams(temperature=0.8, seed=5, max_tokens=4,
                                                                           ignore_eos=True))]
    rids = []
    _proposals(eng, rids)
    run(eng, reqs)
    sampled_steps = sum(1 for ids in rids if "s9" in ids)
    assert 0 < sampled_steps < len(rids) and eng.drafter.graphs.runs == len(rids) - sampled_steps


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
