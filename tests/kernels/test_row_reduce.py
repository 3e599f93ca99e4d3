"""Row reductions (kernels/row_reduce/op.py): Triton (CPU interpreter) against torch's ``sum`` / ``pow(2).mean``.

Tolerance: 2^-20 of sum |x| (of sum x^2 / D): fp32 summation order only. GPU bit-invariance over the row count:
tests/kernels/test_batch_invariant_gpu.py.
"""

import os

import pytest
import torch

from flashtier.kernels.row_reduce.op import mean_square, row_sum

interp = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="CPU Triton needs TRITON_INTERPRET=1")
# name: shape [..., D]; D ragged against the 1024-wide chunk, one D of many chunks
SHAPES = {"one-row": (1, 64), "ragged-d": (7, 1500), "3-d": (3, 4, 96), "long-row": (2, 16384), "d1": (5, 1)}


def _x(shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@interp
@pytest.mark.parametrize("name", list(SHAPES))
def test_triton_matches_torch(name):
    x = _x(SHAPES[name], seed=len(name))
    got, want = row_sum(x, impl="triton"), x.sum(-1)
    assert got.shape == want.shape and float((got - want).abs().max()) <= 2**-20 * float(x.abs().sum(-1).max())
    got, want = mean_square(x, impl="triton"), x.pow(2).mean(-1)
    assert float((got - want).abs().max()) <= 2**-20 * float(want.max())


@interp
def test_a_dropped_chunk_is_detected():
    x = _x((2, 3000), seed=1)
    assert float((row_sum(x, impl="triton") - x[:, :2048].sum(-1)).abs().max()) > 1e-3


@interp
def test_bf16_rows_sum_in_fp32():
    x = _x((3, 300), seed=2).bfloat16()
    got = row_sum(x, impl="triton")
    assert got.dtype == torch.float32 and torch.allclose(got, x.float().sum(-1), atol=1e-4)


def test_cpu_auto_is_torch_bit_for_bit():
    for dt in (torch.float32, torch.float64):
        x = _x((4, 77), seed=3).to(dt)
        assert torch.equal(row_sum(x), x.sum(-1)) and torch.equal(mean_square(x), x.pow(2).mean(-1))


@pytest.mark.parametrize("x, needle", [(torch.zeros(()), "x must be a tensor"), (torch.zeros(3, 0), "D >= 1"),
                                        (torch.zeros(3, 4, dtype=torch.int64), "x must be float32")])
def test_bad_arguments(x, needle):
    with pytest.raises(ValueError, match=needle):
        row_sum(x)
