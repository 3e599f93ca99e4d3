"""The sampler's truncation masks (top-k, top-p, min-p) against a plain float64 Python reference, on random rows
(hypothesis): the kept set lies between the reference's with thresholds narrowed and widened by 1e-5, never
empty; and a seeded sampled token always lies in the reference's support."""

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flashtier.engine.sample.sampler import Sampler
from flashtier.engine.sample.processors import apply_min_p, apply_top_k_top_p
from flashtier.engine.sample.row import SamplerRow, generator_for
from flashtier.engine.sample.params import SamplingParams


def _reference_keep(logits: list[float], top_k: int, top_p: float, min_p: float, slack: float) -> tuple[int, ...]:
    """Kept ids by the documented rules in plain float64 Python, with ``slack`` widening (>0) or
    narrowing (<0) the top-p and min-p thresholds. Ties order by token id."""
    order = sorted(range(len(logits)), key=lambda i: (-logits[i], i))
    n = len(order) if top_k <= 0 else min(top_k, len(order))
    kept = order[:n]
    m = max(logits[i] for i in kept)
    w = [math.exp(logits[i] - m) for i in kept]
    total = sum(w)
    if top_p < 1.0:
        mass, cut = 0.0, len(kept)
        for j, wi in enumerate(w):
            if mass >= top_p + slack:
                cut = j
                break
            mass += wi / total
        kept, w = kept[:cut], w[:cut]
    p_all = [math.exp(v - max(logits)) for v in logits]
    kept = [i for i in kept if p_all[i] >= min_p * p_all[order[0]] * (1 - slack)]
    return tuple(kept)


_row = st.integers(1, 24).flatmap(
    lambda v: st.tuples(
        st.lists(st.one_of(st.floats(-12, 12), st.sampled_from([0.0, 1.0, -1.0])), min_size=v, max_size=v),
        st.sampled_from([-1, 0, 1, 2, 3, 5, 30]),
        st.one_of(st.just(1.0), st.floats(0.01, 1.0)),
        st.one_of(st.just(0.0), st.floats(0.0, 1.0)),
    )
)


@settings(max_examples=150, deadline=None)
@given(row=_row)
def test_masks_match_reference(row):
    values, top_k, top_p, min_p = row
    logits = torch.tensor([values], dtype=torch.float32)
    x = logits.clone()
    apply_top_k_top_p(x, torch.tensor([top_k]), torch.tensor([top_p]))
    apply_min_p(x, torch.tensor([min_p]))
    kept = set(torch.isfinite(x[0]).nonzero().flatten().tolist())
    vals64 = [float(v) for v in logits[0]]
    must = set(_reference_keep(vals64, top_k, top_p, min_p, slack=-1e-5))
    may = set(_reference_keep(vals64, top_k, top_p, min_p, slack=1e-5))
    assert must <= kept <= may, (sorted(must), sorted(kept), sorted(may))
    assert kept  # never empties a row


@settings(max_examples=60, deadline=None)
@given(row=_row, seed=st.integers(0, 2**31))
def test_sampled_token_is_in_reference_support(row, seed):
    values, top_k, top_p, min_p = row
    params = SamplingParams(top_k=top_k, top_p=top_p, min_p=min_p, seed=seed)
    logits = torch.tensor([values], dtype=torch.float32)
    tok = Sampler()(logits, [SamplerRow(params, generator=generator_for(params, "cpu"))]).token_ids.item()
    vals64 = [float(v) for v in logits[0]]
    assert tok in _reference_keep(vals64, top_k, top_p, min_p, slack=1e-5)
