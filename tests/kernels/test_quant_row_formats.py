"""The row-block formats (FP4, MXFP4, FP8) side by side: reference vs Triton byte identity on random rows of
every shape and scale, and half-precision inputs quantised as their fp32 values. Each format's own corners
(ties, scale bytes, records, validation) are in test_quant_<format>.py."""

import pytest
import torch

from flashtier.kernels.quant.fp4 import dequantize_fp4, fp4_qdq, quantize_fp4
from flashtier.kernels.quant.fp8 import dequantize_fp8, fp8_qdq, quantize_fp8
from flashtier.kernels.quant.mxfp4 import dequantize_mxfp4, mxfp4_qdq, quantize_mxfp4

from .quant_checks import check_row_format_impls_agree

pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")

# format: (ops and data name for check_row_format_impls_agree, shapes [..., D] with D a multiple of its block)
FORMATS = {
    "fp4": (
        (quantize_fp4, dequantize_fp4, fp4_qdq, "packed"),
        [(1, 16), (3, 16), (17, 512), (130, 16), (1, 512), (2, 65, 64), (4, 3, 512)],
    ),
    "mxfp4": (
        (quantize_mxfp4, dequantize_mxfp4, mxfp4_qdq, "packed"),
        [(1, 32), (3, 32), (17, 512), (130, 32), (1, 128), (2, 65, 64), (4, 3, 512)],
    ),
    "fp8": (
        (quantize_fp8, dequantize_fp8, fp8_qdq, "codes"),
        [(1, 32), (3, 32), (17, 512), (130, 32), (1, 512), (2, 65, 64), (4, 3, 512)],
    ),
}
SCALES = [1e-6, 1.0, 1e3]
CASES = [(fmt, shape) for fmt, (_, shapes) in FORMATS.items() for shape in shapes]


@pytest.mark.parametrize("scale", SCALES, ids=lambda s: f"scale{s:g}")
@pytest.mark.parametrize("fmt, shape", CASES, ids=lambda v: v if isinstance(v, str) else "x".join(map(str, v)))
def test_random_reference_matches_triton(fmt, shape, scale):
    check_row_format_impls_agree(torch.randn(shape) * scale, *FORMATS[fmt][0])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_half_inputs_match_fp32_of_same_values(fmt, dtype):
    ops = FORMATS[fmt][0]
    x = (torch.randn(17, 512) * 3).to(dtype)
    data, scales = check_row_format_impls_agree(x, *ops)
    f_data, f_scales = ops[0](x.float())
    assert torch.equal(data, f_data) and torch.equal(scales, f_scales)
