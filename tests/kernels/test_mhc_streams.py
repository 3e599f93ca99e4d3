"""mHC stream collapse / update (kernels/mhc/streams.py): Triton (CPU interpreter) against the plain-torch
expressions the model ran before. Tolerance 2^-21 of the sum of |terms| (fp32 order only). GPU bit-invariance
over the token count: tests/kernels/test_batch_invariant_gpu.py.
"""

import os

import pytest
import torch

from flashtier.kernels.mhc.streams import hc_collapse, hc_expand

interp = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="CPU Triton needs TRITON_INTERPRET=1")
# name: (T, hc, D); D ragged against the 1024-wide block
SHAPES = {"one-token": (1, 4, 64), "ragged-d": (5, 4, 1500), "hc2": (3, 2, 100), "many": (33, 4, 256)}


def _case(t, hc, d, seed=0, xdt=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, hc, d, generator=g).to(xdt)
    f = torch.randn(t, d, generator=g).to(xdt)
    return x, f, torch.rand(t, hc, generator=g), torch.rand(t, hc, generator=g), torch.rand(t, hc, hc, generator=g)


@interp
@pytest.mark.parametrize("xdt", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", list(SHAPES))
def test_triton_matches_reference(name, xdt):
    x, f, pre, post, comb = _case(*SHAPES[name], seed=len(name), xdt=xdt)
    got, want = hc_collapse(x, pre, impl="triton"), hc_collapse(x, pre, impl="reference")
    bound = (pre[..., None] * x.float().abs()).sum(-2)
    assert got.dtype == torch.float32 and float(((got - want).abs() - 2**-21 * bound).max()) <= 0
    got, want = hc_expand(f, x, post, comb, impl="triton"), hc_expand(f, x, post, comb, impl="reference")
    bound = post[..., None] * f.float().abs()[:, None, :] + torch.einsum("tjk,tjd->tkd", comb, x.float().abs())
    assert got.shape == want.shape and float(((got - want).abs() - 2**-21 * bound).max()) <= 0


@interp
def test_a_transposed_mix_is_detected():
    x, f, pre, post, comb = _case(4, 4, 128, seed=9)
    got = hc_expand(f, x, post, comb.transpose(1, 2).contiguous(), impl="triton")
    assert float((got - hc_expand(f, x, post, comb, impl="reference")).abs().max()) > 1e-2


def test_cpu_auto_is_the_reference():
    x, f, pre, post, comb = _case(3, 4, 32, seed=1)
    assert torch.equal(hc_collapse(x, pre), (pre[..., None] * x).sum(-2))
    assert torch.equal(hc_expand(f, x, post, comb), post[..., None] * f[:, None, :] + torch.einsum("tjk,tjd->tkd", comb, x))


def test_bad_arguments():
    x, f, pre, post, comb = _case(3, 4, 32)
    with pytest.raises(ValueError, match="pre must have shape"):
        hc_collapse(x, pre[:2])
    with pytest.raises(ValueError, match="hc must be a power of two"):
        hc_collapse(torch.zeros(3, 3, 8), torch.zeros(3, 3))
    with pytest.raises(ValueError, match="comb must have shape"):
        hc_expand(f, x, post, comb[:, :2])
