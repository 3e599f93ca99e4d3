"""Batch-invariant linear (kernels/invariant_linear/op.py): Triton against the plain-torch reference on the CPU
interpreter, the two launch forms against each other, and the argument checks. The bit-for-bit invariance on the
GPU is tests/kernels/test_batch_invariant_gpu.py.

Error metric: |y - ref| <= tol * bound elementwise, bound = |x| @ |w|^T (what summation error scales with).
CPU (TRITON_INTERPRET=1: fp32 dots on upcast values): fp32 out 2^-20 (summation order only); bf16 out
2^-8 + 2^-20 (one bf16 rounding of y, at most half an ulp, 2^-8 |y| <= 2^-8 bound).
"""

import os

import pytest
import torch

from flashtier.kernels.invariant_linear.op import LinearConfig, linear, linear_reference

interp = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="CPU Triton needs TRITON_INTERPRET=1")
TOL = {torch.float32: 2**-20, torch.bfloat16: 2**-8 + 2**-20}

# name: (M, N, K, x dtype, w dtype); N and K ragged against the 64-row tiles and the 32 / 64 K steps
SHAPES = {
    "one-row-fp32": (1, 24, 1000, torch.float32, torch.float32),  # the mHC mixes: 24 outputs, long K (splits)
    "bf16-ragged": (5, 70, 96, torch.bfloat16, torch.bfloat16),
    "fp32-x-bf16-w": (3, 130, 2048, torch.float32, torch.bfloat16),  # the fp32 head over its bf16 weight
    "seventeen": (17, 64, 160, torch.bfloat16, torch.bfloat16),
    "prefill-67": (67, 40, 200, torch.float32, torch.bfloat16),  # > 64 rows: splits inside each program
    "prefill-130-fp32": (130, 33, 640, torch.float32, torch.float32),
}


def _case(m, n, k, xd, wd, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(m, k, generator=g).to(xd), torch.randn(n, k, generator=g).to(wd)


def _check(got, x, w):
    want = linear_reference(x, w).float()
    bound = linear_reference(x.float().abs(), w.float().abs())
    assert got.dtype == x.dtype and got.shape == want.shape
    err = ((got.float() - want).abs() - TOL[x.dtype] * bound).max()
    assert float(err) <= 0, f"max excess {float(err):.3g}"


@interp
@pytest.mark.parametrize("name", list(SHAPES))
def test_triton_matches_reference(name):
    x, w = _case(*SHAPES[name])
    _check(linear(x, w, impl="triton"), x, w)


@interp
@pytest.mark.parametrize("split", [1, 2, 3, 8])
def test_splits_keep_the_reference(split):
    x, w = _case(9, 48, 1000, torch.float32, torch.float32, seed=split)
    _check(linear(x, w, impl="triton", config=LinearConfig(block_m=16, block_k=32, split_k=split)), x, w)


@interp
def test_inline_splits_equal_the_split_launch():
    # rows 0..2 alone (split programs + the ordered reduce) and inside 70 rows (splits inside each program):
    # the same partial sums added in the same order, so the same bits
    x, w = _case(70, 40, 1024, torch.float32, torch.float32, seed=3)
    cfg = LinearConfig(block_m=16, block_k=32, split_k=4)
    assert torch.equal(linear(x[:3], w, impl="triton", config=cfg), linear(x, w, impl="triton", config=cfg)[:3])


@interp
def test_a_wrong_weight_row_is_detected():
    x, w = _case(4, 64, 128, torch.float32, torch.float32, seed=5)
    bad = w.clone()
    bad[7, 3] += 1.0
    with pytest.raises(AssertionError):
        _check(linear(x, bad, impl="triton"), x, w)


def test_cpu_auto_is_the_reference_bit_for_bit():
    for xd in (torch.float32, torch.float64):
        x, w = _case(6, 20, 64, xd, xd, seed=7)
        assert torch.equal(linear(x, w), torch.nn.functional.linear(x, w))
    x, w = _case(6, 20, 64, torch.float32, torch.bfloat16, seed=8)
    assert torch.equal(linear(x, w), torch.nn.functional.linear(x, w.float()))


def test_empty_batch():
    x, w = _case(0, 8, 32, torch.float32, torch.float32)
    assert linear(x, w).shape == (0, 8)


@pytest.mark.parametrize("args, needle", [
    ((torch.zeros(2, 3), torch.zeros(4, 5)), "share a positive K"),
    ((torch.zeros(2, 3, 4), torch.zeros(4, 4)), "x must be a 2-D tensor"),
    ((torch.zeros(2, 4, dtype=torch.int32), torch.zeros(4, 4, dtype=torch.int32)), "x must be float32"),
    ((torch.zeros(2, 4, dtype=torch.bfloat16), torch.zeros(3, 4)), "w must be x's dtype"),
])
def test_bad_arguments_raise_value_errors_naming_them(args, needle):
    with pytest.raises(ValueError, match=needle):
        linear(*args)


@pytest.mark.gpu
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="needs compiled Triton")
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("m", [1, 8, 64, 65])
def test_cuda_fp32_mode_is_near_fp32(m):
    # mode 2 (fp32 x, fp32 w: the mHC mixes [24, 4 x 5120]) runs six bf16 part products on the tensor cores: within
    # 2^-18 of sum |x*w| of the float64 product (dropped part products < 2^-32; fp32 accumulation in the MMA)
    g = torch.Generator(device="cuda").manual_seed(m)
    x = torch.randn(m, 20480, generator=g, device="cuda")
    w = torch.randn(24, 20480, generator=g, device="cuda") * 0.05
    got = linear(x, w, impl="triton").double()
    err = (got - x.double() @ w.double().T).abs() / (x.double().abs() @ w.double().abs().T)
    assert float(err.max()) <= 2**-18, f"{float(err.max()):.2e}"
