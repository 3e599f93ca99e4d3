"""RMSNorm (kernels/rms_norm/op.py): Triton (CPU interpreter) against the torch expression; GPU bit-invariance over
the row count is tests/kernels/test_batch_invariant_gpu.py. Tolerance 2^-20 relative to max |y| (fp32 order of
the sum of squares, the rsqrt and two products).
"""

import os

import pytest
import torch

from flashtier.kernels.rms_norm.op import rms_norm, rms_norm_reference

interp = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="CPU Triton needs TRITON_INTERPRET=1")
SHAPES = {"one-row": (1, 64), "ragged-d": (7, 1500), "3-d": (2, 3, 96), "wide": (2, 5120)}


def _case(shape, seed=0, dt=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * 3).to(dt), torch.rand(shape[-1], generator=g) + 0.5


@interp
@pytest.mark.parametrize("dt", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", list(SHAPES))
def test_triton_matches_reference(name, dt):
    x, w = _case(SHAPES[name], seed=len(name), dt=dt)
    got, want = rms_norm(x, w, 1e-6, impl="triton"), rms_norm_reference(x, w, 1e-6)
    assert got.dtype == torch.float32 and got.shape == want.shape
    assert float((got - want).abs().max()) <= 2**-20 * float(want.abs().max())


@interp
def test_a_wrong_eps_is_caught():
    x, w = _case((3, 64), seed=1)
    x[0] *= 1e-4  # a row whose mean square is of the order of eps
    got = rms_norm(x, w, 1e-6, impl="triton")
    assert float((got - rms_norm_reference(x, w, 1e-4)).abs().max()) > 1e-3


def test_cpu_auto_is_the_torch_expression_bit_for_bit():
    for dt in (torch.float32, torch.float64):
        x, w = _case((4, 33), seed=2, dt=dt)
        want = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w.to(dt)
        assert torch.equal(rms_norm(x, w.to(dt), 1e-6), want)


def test_bad_arguments():
    x, w = _case((3, 8))
    with pytest.raises(ValueError, match="weight must have shape"):
        rms_norm(x, w[:4], 1e-6)
    with pytest.raises(ValueError, match="x must be float32"):
        rms_norm(x.long(), w, 1e-6)
