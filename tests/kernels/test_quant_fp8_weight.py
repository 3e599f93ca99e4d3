"""fp8_weight (checkpoint FP8, ue8m0 scale per 2-D block): reference vs Triton byte identity and layout."""

import pytest
import torch

from flashtier.kernels.quant.fp8_weight import (
    as_e4m3fn,
    as_e8m0,
    as_raw_bytes,
    dequantize_fp8_weight,
    quantize_fp8_weight,
)
from flashtier.kernels.quant.fp8 import quantize_fp8

from .quant_checks import assert_same_bytes, u8

pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")

CASES = [
    ((100, 96), (32, 32)),  # ragged block rows
    ((64, 64), (32, 32)),
    ((33, 17), (32, 32)),  # ragged both ways, one column block
    ((1, 1), (32, 32)),
    ((37, 256), (1, 32)),  # Engram rows: scale [R, 8]
    ((5, 50), (1, 32)),
    ((33, 17), (16, 8)),
    ((130, 130), (128, 128)),
]


def check_impls_agree(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    q, scale = quantize_fp8_weight(w, block, impl="reference")
    t_q, t_scale = quantize_fp8_weight(w, block, impl="triton")
    assert q.dtype == torch.float8_e4m3fn and scale.dtype == torch.float8_e8m0fnu
    assert_same_bytes("q", as_raw_bytes(q), as_raw_bytes(t_q))
    assert_same_bytes("scale", as_raw_bytes(scale), as_raw_bytes(t_scale))
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        ref = dequantize_fp8_weight(q, scale, block, dtype, impl="reference")
        assert_same_bytes(f"dequantize {dtype}", ref, dequantize_fp8_weight(q, scale, block, dtype, impl="triton"))
    return q, scale


@pytest.mark.parametrize("scale", [1e-6, 1.0, 1e3], ids=lambda s: f"scale{s:g}")
@pytest.mark.parametrize("shape, block", CASES, ids=lambda c: "x".join(map(str, c)))
def test_random_reference_matches_triton(shape, block, scale):
    q, s = check_impls_agree(torch.randn(shape) * scale, block)
    assert q.shape == shape
    assert s.shape == (-(-shape[0] // block[0]), -(-shape[1] // block[1]))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_inputs_and_transposed_views(dtype):
    w = (torch.randn(96, 70) * 5).to(dtype)
    check_impls_agree(w, (32, 32))
    wt = torch.randn(70, 96).t()  # [96, 70] with strides (1, 96): the kernel reads through the strides
    ref, tri = quantize_fp8_weight(wt, impl="reference")[0], quantize_fp8_weight(wt, impl="triton")[0]
    assert_same_bytes("q", as_raw_bytes(ref), as_raw_bytes(tri))


def test_edge_inputs():
    w = torch.zeros(64, 64)
    w[0, 0], w[0, 1], w[1, 0] = 448.0, 1.0, -0.0  # block (0, 0): s = 1
    w[32, 32] = 449.0  # block (1, 1): s = 2
    w[32, 0] = 1e30  # block (1, 0): one huge element
    w[40:, :32] = torch.randn(24, 32) * 1e-3
    # block (0, 1) stays zero: amax floor 1e-4 -> s = 2^-22 (byte 105)
    for impl in ("reference", "triton"):
        q, scale = quantize_fp8_weight(w, impl=impl)
        assert as_raw_bytes(scale)[0].tolist() == [127, 105]
        assert as_raw_bytes(scale)[1, 1].item() == 128
        assert as_raw_bytes(q)[0, :2].tolist() == [0x7E, 0x38] and as_raw_bytes(q)[1, 0].item() == 0x80
    check_impls_agree(w, (32, 32))
    check_impls_agree(torch.exp2(torch.randint(-60, 60, (64, 1)).float()) * torch.randn(64, 96), (1, 32))


def test_row_blocks_match_window_kv_fp8():
    # block (1, 32) is the window-KV rule applied per row: same bytes as quantize_fp8.
    w = torch.randn(37, 256) * 7
    q, scale = quantize_fp8_weight(w, (1, 32))
    codes, scales = quantize_fp8(w)
    assert torch.equal(as_raw_bytes(q), codes) and torch.equal(as_raw_bytes(scale), scales)


def test_round_trip_and_raw_byte_inputs():
    w = torch.randn(100, 96) * torch.exp2(torch.randint(-10, 10, (100, 1)).float())
    q, scale = quantize_fp8_weight(w)
    s = scale.float().repeat_interleave(32, 0).repeat_interleave(32, 1)[:100, :96]
    deq = dequantize_fp8_weight(q, scale)
    assert ((deq - w).abs() <= torch.maximum(w.abs() * 2**-4, s * 2**-10)).all()
    raw = dequantize_fp8_weight(as_raw_bytes(q), as_raw_bytes(scale), impl="triton")
    assert torch.equal(raw, deq)
    assert torch.equal(as_raw_bytes(as_e4m3fn(as_raw_bytes(q))), as_raw_bytes(q))
    assert as_e8m0(as_raw_bytes(scale)).dtype == torch.float8_e8m0fnu


def test_empty():
    for impl in ("reference", "triton"):
        q, scale = quantize_fp8_weight(torch.randn(0, 64), impl=impl)
        assert q.shape == (0, 64) and scale.shape == (0, 2)
        assert dequantize_fp8_weight(q, scale, impl=impl).shape == (0, 64)


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: quantize_fp8_weight(torch.randn(64)), "2-D"),
        (lambda: quantize_fp8_weight(torch.randn(4, 32, dtype=torch.float64)), "2-D float32"),
        (lambda: quantize_fp8_weight(torch.randn(4, 32), block=(3, 32)), "powers of two"),
        (lambda: quantize_fp8_weight(torch.randn(4, 32), block=(0, 32)), "powers of two"),
        (lambda: quantize_fp8_weight(torch.randn(4, 32), block=(256, 256)), "powers of two"),
        (lambda: quantize_fp8_weight(torch.randn(4, 32), impl="gpu"), "impl"),
        (lambda: dequantize_fp8_weight(torch.zeros(64, 64), u8(2, 2)), "float8_e4m3fn"),
        (lambda: dequantize_fp8_weight(u8(64, 64), torch.zeros(2, 2)), "float8_e8m0fnu"),
        (lambda: dequantize_fp8_weight(u8(64, 64), u8(2, 3)), r"\(2, 2\)"),
        (lambda: dequantize_fp8_weight(u8(37, 256), u8(37, 8)), r"\(2, 8\)"),
        (lambda: as_raw_bytes(torch.zeros(4)), "one-byte"),
    ],
)
def test_validation_errors(call, match):
    with pytest.raises(ValueError, match=match):
        call()
