"""The engine's reference pass (engine/model/reference.py) against an independent forward, layer by layer.

``independent_forward.py`` is written from reference/model.md and shares no module with engine/model or
kernels/ (only the parameters, read by checkpoint name). Both run ``tiny`` in float64 on plans (a) full,
(b) CED and (c) encoder bounded replay; after every layer of every run the residual streams and the
collapse coefficients must agree to 1e-10 relative (max |a - b| / max |b|); the logits, which the engine
hands out in fp32, must equal ours rounded to fp32 (up to 1e-10). Measured: see the report printed by -s.
"""

import pytest
import torch

import flashtier.engine.model.reference as engine_reference
from flashtier.engine.model.reference import Plan, reference_forward
from flashtier.kernels.quant.fp4 import fp4_qdq as kernel_fp4_qdq
from flashtier.kernels.quant.fp8 import fp8_qdq as kernel_fp8_qdq
from flashtier.kernels.quant.mxfp4 import mxfp4_qdq as kernel_mxfp4_qdq

from . import independent_forward as ind
from .conftest import random_prompt, rel_err
from .independent_quant import fp4_qdq, fp8_qdq, mxfp4_qdq

TOL = 1e-10
N, T, R = 48, 56, 32  # prompt, total tokens, resume point (tiny: window 16, top-k 8, pool 4 x 8 entries)


def engine_pass(model, tokens, plan, monkeypatch):
    """The engine's logits and its per-layer (part, layer, first position, streams, pre), captured around
    ``layer_forward`` without changing it."""
    records, inner = [], engine_reference.layer_forward
    n_enc = model.cfg.n_encoder_layers

    def recording(block, x, pre, pos, *args, **kw):
        out = inner(block, x, pre, pos, *args, **kw)
        part = "encoder" if block.role.index < n_enc else "decoder"
        records.append((part, block.role.index, int(pos[0]), out[0].clone(), out[1].clone()))
        return out

    monkeypatch.setattr(engine_reference, "layer_forward", recording)
    return reference_forward(model, tokens, plan).logits, records


def plans(w: int):
    return {
        "a_full": (Plan.full(T), ind.plan_full(T)),
        "b_ced": (Plan.ced(N, T, w), ind.plan_ced(N, T, w)),
        "c_resume": (Plan.resume(R, N, T, w), ind.plan_resume(R, N, T, w)),
    }


def compare(eng, ours) -> tuple[float, tuple | None]:
    """Worst relative error over all layers (streams and pre) and the first record above TOL."""
    assert [r[:2] for r in eng] == [r[:2] for r in ours], "the two passes ran different layers"
    worst, first_bad = 0.0, None
    for (part, layer, e0, ex, epre), (_, _, o0, ox, opre) in zip(eng, ours):
        rows = slice(o0 - e0, o0 - e0 + ox.shape[0])  # the engine's first encoder run may cover more tokens
        err = max(rel_err(ox, ex[rows]), rel_err(opre, epre[rows]))
        worst = max(worst, err)
        if err > TOL and first_bad is None:
            first_bad = (part, layer, err)
    return worst, first_bad


@pytest.mark.parametrize("name", ["a_full", "b_ced", "c_resume"])
def test_layer_by_layer_equal_to_the_independent_forward(tiny64, tiny_cfg, monkeypatch, name):
    eng_plan, our_plan = plans(tiny_cfg.sliding_window)[name]
    tokens = torch.tensor(random_prompt(T, seed=21))
    logits, eng = engine_pass(tiny64, tokens, eng_plan, monkeypatch)
    our_logits, ours = ind.forward(tiny64, tokens, our_plan)
    worst, first_bad = compare(eng, ours)
    assert first_bad is None, f"first layer above {TOL}: {first_bad}"
    done = ~torch.isnan(logits[:, 0])
    assert bool(done.any()) and torch.equal(done, ~torch.isnan(our_logits[:, 0]))
    # reference_forward hands its logits out in fp32: equal to ours rounded to nearest, up to TOL
    ours_done, theirs = our_logits[done], logits[done].double()
    excess = ((ours_done - theirs).abs() - 2.0**-24 * ours_done.abs()).max() / ours_done.abs().max()
    assert logits.dtype == torch.float32 and float(excess) <= TOL
    print(f"{name}: worst layer error {worst:.1e}, logits within fp32 rounding + {max(float(excess), 0):.1e}")


def test_the_comparison_finds_a_broken_layer(tiny64, tiny_cfg, monkeypatch):
    """A deliberately broken independent pass (layer 5's mHC base moved by 1e-6, then the activation
    quantisation switched off) is caught, at the layer that differs."""
    eng_plan, our_plan = plans(tiny_cfg.sliding_window)["b_ced"]
    tokens = torch.tensor(random_prompt(T, seed=21))
    _, eng = engine_pass(tiny64, tokens, eng_plan, monkeypatch)
    weights = ind.Weights.__getitem__

    def nudged(self, name):
        w = weights(self, name)
        return w + 1e-6 if name == "layers.5.hc_attn_base" else w

    monkeypatch.setattr(ind.Weights, "__getitem__", nudged)
    _, first_bad = compare(eng, ind.forward(tiny64, tokens, our_plan)[1])
    assert first_bad is not None and first_bad[:2] == ("encoder", 5)
    monkeypatch.setattr(ind.Weights, "__getitem__", weights)
    monkeypatch.setattr(ind, "ACT_QUANT", not ind.ACT_QUANT)
    _, first_bad = compare(eng, ind.forward(tiny64, tokens, our_plan)[1])
    assert first_bad is not None and first_bad[:2] == ("encoder", 0) and first_bad[2] > 1e-6


@pytest.mark.parametrize("ours, kernel", [(fp8_qdq, kernel_fp8_qdq), (fp4_qdq, kernel_fp4_qdq),
                                          (mxfp4_qdq, kernel_mxfp4_qdq)], ids=["fp8", "fp4", "mxfp4"])
def test_independent_quantisers_equal_the_kernels(ours, kernel):
    """The two implementations of each format agree bit for bit (signed zeros included)."""
    g = torch.Generator().manual_seed(4)
    x = torch.randn(256, 128, generator=g, dtype=torch.float64)
    x = x * torch.exp2(torch.randint(-30, 30, (256, 1), generator=g)).double()
    x[::7, ::3] = -0.0
    x[1::5, :32] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0] * 4, dtype=torch.float64)
    a, b = ours(x), kernel(x.float(), impl="reference").double()
    assert torch.equal(a.view(torch.int64), b.view(torch.int64))
