"""moe_route: the Triton kernels against the plain-torch reference, bit for bit (indices and weights).

Grids: tokens N in {1, 3, 17, 64, 300} x (experts, top-k) in {(16, 6), (8, 2)}, on the CPU with the
kernels interpreted (D = 64, the tiny preset's width, and D = 1100: five float64 partial-sum chunks of 256,
the last ragged). Data kinds:
- "randn": real-valued activations and gate rows;
- "ties": activations and gate rows on a coarse grid (every partial sum exact in any order), each gate row
  and bias value repeated for two experts, so every pair of experts ties and the lower index must win;
- "saturated": logits far beyond +-20 (the softplus threshold and exp underflow);
- all-equal scores (zero gate): the first k experts, equal weights.
GPU (``-m gpu``): the real geometry (D = 5120, 16 and 384 experts, top-6), CUDA kernels vs the CPU reference,
on "ties" and "gridded" (Gaussian values on a 2^-10 / 2^-14 grid, so the float64 logits are exact).

Tolerance: none. The scores are float64 evaluations rounded once to fp32, so two implementations differ
only when the float64 softplus falls within their float64 error of an fp32 rounding boundary: ~2^-27 per
score from exp / log, more (~2e-8 at D = 5120) when the float64 logit sums also differ by order, which is
why the GPU grid uses exact logits. These seeded CPU grids have no such score. A perturbed input is shown
to fail the comparison.
"""

import os

import pytest
import torch

from flashtier.kernels.moe.route import moe_route
from flashtier.kernels.moe.route_reference import moe_route_reference

TOKENS = [1, 3, 17, 64, 300]
EXPERTS = [(16, 6), (8, 2)]


def make_case(n, e, d, kind, seed=0, device="cpu"):
    g = torch.Generator(device=device).manual_seed(seed)
    if kind == "ties":  # multiples of 1/8 and 1/16: every product and partial sum is exact in fp32
        x = torch.randint(-8, 9, (n, d), generator=g, device=device) / 8.0
        w = (torch.randint(-4, 5, (e // 2, d), generator=g, device=device) / 16.0).repeat_interleave(2, dim=0)
        bias = (torch.randint(-4, 5, (e // 2,), generator=g, device=device) / 32.0).repeat_interleave(2)
        return x, w, bias.float()
    x = torch.randn(n, d, generator=g, device=device)
    w = torch.randn(e, d, generator=g, device=device) / d**0.5
    if kind == "saturated":
        x = x * 60.0
    if kind == "gridded":  # multiples of 2^-10 and 2^-14: every float64 partial sum is exact, in any order
        x, w = torch.round(x * 1024) / 1024, torch.round(w * 16384) / 16384
    return x, w, 0.1 * torch.randn(e, generator=g, device=device)


def assert_same_route(ref, out):
    (ri, rw), (oi, ow) = ref, out
    assert oi.dtype == torch.int32 and ow.dtype == rw.dtype
    assert torch.equal(ri, oi.cpu()), f"indices differ in {int((ri != oi.cpu()).any(1).sum())} rows"
    assert torch.equal(rw, ow.cpu()), f"weights differ in {int((rw != ow.cpu()).sum())} places"


@pytest.mark.parametrize("e,k", EXPERTS, ids=lambda v: str(v))
@pytest.mark.parametrize("n", TOKENS)
@pytest.mark.parametrize("kind", ["randn", "ties"])
def test_triton_equals_reference(kind, n, e, k):
    x, w, bias = make_case(n, e, 64, kind, seed=n)
    ref = moe_route_reference(x, w, bias, k, 1.5)
    assert_same_route(ref, moe_route(x, w, bias, k, 1.5, impl="triton"))
    if kind == "ties":  # within a tied pair the lower expert comes first
        i = ref[0].long()
        pairs = (i[:, :-1] // 2 == i[:, 1:] // 2)
        assert bool((i[:, 1:][pairs] == i[:, :-1][pairs] + 1).all())


@pytest.mark.parametrize("kind,d,temp", [("randn", 1100, 1.0), ("saturated", 64, 1.0), ("randn", 64, 0.7)])
def test_chunks_threshold_temperature(kind, d, temp):
    x, w, bias = make_case(33, 16, d, kind, seed=d)
    ref = moe_route_reference(x, w, bias, 6, 2.5, gate_temp=temp)
    assert_same_route(ref, moe_route(x, w, bias, 6, 2.5, gate_temp=temp, impl="triton"))


def test_all_equal_scores_take_the_first_experts():
    x, w, bias = torch.randn(5, 64), torch.zeros(16, 64), torch.zeros(16)
    idx, wt = moe_route(x, w, bias, 6, 1.5, impl="triton")
    assert torch.equal(idx, torch.arange(6, dtype=torch.int32).expand(5, 6))
    assert_same_route(moe_route_reference(x, w, bias, 6, 1.5), (idx, wt))


def test_bias_selects_but_does_not_weight():
    x, w, _ = make_case(9, 8, 64, "randn")
    bias = torch.tensor([0.0, 0, 0, 0, 0, 0, 50.0, 40.0])  # experts 6 and 7 win whatever their scores
    idx, wt = moe_route(x, w, bias, 2, 1.0, impl="triton")
    assert torch.equal(idx, torch.tensor([[6, 7]] * 9, dtype=torch.int32))
    s = torch.sqrt(torch.nn.functional.softplus(x.double() @ w.double().T).float())[:, 6:]
    torch.testing.assert_close(wt, s / s.sum(1, keepdim=True), rtol=2e-7, atol=0)


def test_top1_is_not_normalised():
    x, w, bias = make_case(7, 8, 64, "randn")
    idx, wt = moe_route(x, w, bias, 1, 1.5, impl="triton")
    assert_same_route(moe_route_reference(x, w, bias, 1, 1.5), (idx, wt))
    assert bool((wt != 1.5).all())  # the raw score times the scale (official: norm_topk_prob and topk > 1)


def test_matches_the_official_formula_away_from_ties():
    """The official Gate: fp32 F.softplus(...).sqrt(), torch.topk, weights /= sum + 1e-20, *= route_scale."""
    x, w, bias = make_case(64, 16, 64, "randn", seed=5)
    scores = torch.nn.functional.softplus(x @ w.T).sqrt()
    top = (scores + bias).topk(6, dim=-1)
    official = scores.gather(1, top.indices)
    official = official / (official.sum(-1, keepdim=True) + 1e-20) * 1.5
    idx, wt = moe_route(x, w, bias, 6, 1.5, impl="triton")
    assert torch.equal(idx.long(), top.indices)  # no near-ties in this seed
    torch.testing.assert_close(wt, official, rtol=1e-6, atol=0)


def test_token_alone_equals_token_in_batch():
    x, w, bias = make_case(64, 16, 600, "randn", seed=1)
    idx, wt = moe_route(x, w, bias, 6, 1.5, impl="triton")
    for t in (0, 37, 63):
        it, wt1 = moe_route(x[t : t + 1], w, bias, 6, 1.5, impl="triton")
        assert torch.equal(it[0], idx[t]) and torch.equal(wt1[0], wt[t])


def test_a_perturbed_input_is_detected():
    x, w, bias = make_case(17, 16, 64, "randn", seed=2)
    out = moe_route(x, w, bias, 6, 1.5, impl="triton")
    x[5, 3] += 1e-3  # one activation of one token
    with pytest.raises(AssertionError, match="weights differ"):
        assert_same_route(moe_route_reference(x, w, bias, 6, 1.5), out)


def test_float64_runs_the_reference():
    x, w, bias = make_case(3, 8, 64, "randn")
    idx, wt = moe_route(x.double(), w.double(), bias.double(), 2, 1.5)
    assert wt.dtype == torch.float64 and torch.equal(idx, moe_route_reference(x, w, bias, 2, 1.5)[0])
    with pytest.raises(ValueError, match="float64 runs with impl='reference'"):
        moe_route(x.double(), w, bias, 2, 1.5, impl="triton")


@pytest.mark.parametrize("change,match", [
    (dict(x=torch.zeros(3)), "x must be a 2-D"),
    (dict(x=torch.zeros(3, 32)), r"x must be \[N, 64\]"),
    (dict(bias=torch.zeros(7)), r"bias must be a float32 \(or float64\) tensor \[8\]"),
    (dict(top_k=9), r"top_k must be an int in \[1, 8\]"),
    (dict(route_scale=0.0), "route_scale must be a positive finite number"),
    (dict(gate_temp=float("nan")), "gate_temp must be a positive finite number"),
    (dict(impl="cuda"), "impl must be one of"),
])
def test_bad_arguments_raise(change, match):
    x, w, bias = make_case(3, 8, 64, "randn")
    args = dict(x=x, gate_weight=w, bias=bias, top_k=2, route_scale=1.5, gate_temp=1.0, impl="auto") | change
    with pytest.raises(ValueError, match=match):
        moe_route(**args)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="needs compiled Triton (TRITON_INTERPRET=0)")
@pytest.mark.parametrize("e", [16, 384])
@pytest.mark.parametrize("n", TOKENS)
@pytest.mark.parametrize("kind", ["gridded", "ties"])
def test_real_geometry_gpu(kind, n, e):
    x, w, bias = make_case(n, e, 5120, kind, seed=n, device="cuda")
    out = moe_route(x, w, bias, 6, 1.5)
    assert_same_route(moe_route_reference(x.cpu(), w.cpu(), bias.cpu(), 6, 1.5), out)
    for t in {0, n - 1}:  # batch invariance on the device
        alone = moe_route(x[t : t + 1], w, bias, 6, 1.5)
        assert torch.equal(alone[0][0], out[0][t]) and torch.equal(alone[1][0], out[1][t])
