"""mHC coefficients: the Triton kernel (one launch, Sinkhorn in registers) against the plain-torch reference.

Interpreted on the CPU at ragged token counts; ``-m gpu`` at prefill sizes. Tolerance 2e-6 absolute (the
coefficients are O(1); exp and division may differ by an ulp per op over 2 * 20 normalisations).
"""

import os

import pytest
import torch

from flashtier.kernels.mhc.coeffs import mhc_coeffs
from flashtier.kernels.mhc.coeffs_reference import mhc_coeffs_reference

HC, ITERS, EPS = 4, 20, 1e-6
TOL = 2e-6
TOKENS = {"one": 1, "three": 3, "seventeen": 17, "sixty-four": 64, "ragged-300": 300}


def _case(t: int, seed: int, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    n = (2 + HC) * HC
    m = (torch.randn(t, n, generator=g) * 2).to(device)
    base = (torch.randn(n, generator=g) * 0.5).to(device)
    scale = (torch.randn(3, generator=g) * 0.2 + 1).to(device)
    return m, base, scale


def _assert_close(got, want):
    for g, w, name in zip(got, want, ("pre", "post", "comb")):
        assert g.shape == w.shape, name
        err = float((g - w).abs().max()) if g.numel() else 0.0
        assert err <= TOL, f"{name}: {err:.3g}"


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="CPU Triton needs TRITON_INTERPRET=1")
@pytest.mark.parametrize("name", list(TOKENS))
def test_triton_matches_reference_interpreted(name):
    m, base, scale = _case(TOKENS[name], seed=TOKENS[name])
    want = mhc_coeffs_reference(m, base, scale, HC, EPS, ITERS)
    _assert_close(mhc_coeffs(m, base, scale, hc=HC, hc_eps=EPS, iters=ITERS, impl="triton"), want)
    # the result is a doubly-stochastic-ish mixing: columns sum to ~1 after the last normalisation
    assert torch.allclose(want[2].sum(-2), torch.ones(TOKENS[name], HC), atol=1e-4)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="CPU Triton needs TRITON_INTERPRET=1")
def test_detects_a_wrong_iteration_count():
    m, base, scale = _case(17, seed=5)
    want = mhc_coeffs_reference(m, base, scale, HC, EPS, ITERS)
    got = mhc_coeffs(m, base, scale, hc=HC, hc_eps=EPS, iters=2, impl="triton")
    with pytest.raises(AssertionError):
        _assert_close(got, want)


def test_float64_runs_the_reference_and_validates():
    m, base, scale = _case(3, seed=1)
    pre, post, comb = mhc_coeffs(m.double(), base.double(), scale.double(), hc=HC, hc_eps=EPS, iters=ITERS)
    assert comb.dtype == torch.float64
    with pytest.raises(ValueError, match="m must be"):
        mhc_coeffs(m[:, :5], base, scale, hc=HC, hc_eps=EPS, iters=ITERS)
    with pytest.raises(ValueError, match="power of two"):
        mhc_coeffs(m, base, scale, hc=3, hc_eps=EPS, iters=ITERS)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="needs compiled Triton")
@pytest.mark.parametrize("t", [1, 64, 4097])
def test_triton_matches_reference_gpu(t):
    m, base, scale = _case(t, seed=t, device="cuda")
    _assert_close(mhc_coeffs(m, base, scale, hc=HC, hc_eps=EPS, iters=ITERS),
                  mhc_coeffs_reference(m, base, scale, HC, EPS, ITERS))


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="CPU Triton needs TRITON_INTERPRET=1")
def test_the_rms_factor_inside_the_launch():
    """``ms`` given: the kernel applies ``rsqrt(ms + eps)`` to m as it reads it; the reference multiplies first."""
    m, base, scale = _case(17, seed=8)
    ms = torch.rand(17, generator=torch.Generator().manual_seed(9)) * 4 + 0.1
    want = mhc_coeffs_reference(m * torch.rsqrt(ms[:, None] + 1e-6), base, scale, HC, EPS, ITERS)
    _assert_close(mhc_coeffs(m, base, scale, hc=HC, hc_eps=EPS, iters=ITERS, ms=ms, norm_eps=1e-6, impl="triton"), want)
    _assert_close(mhc_coeffs(m, base, scale, hc=HC, hc_eps=EPS, iters=ITERS, ms=ms, norm_eps=1e-6), want)
    with pytest.raises(AssertionError):  # the factor matters: leaving it out is caught
        _assert_close(mhc_coeffs(m, base, scale, hc=HC, hc_eps=EPS, iters=ITERS, impl="triton"), want)
