"""Checks shared by the quantisation format tests (test_quant_fp4 / mxfp4 / fp8 / fp8_weight)."""

from collections.abc import Callable

import torch


def assert_same_bytes(name: str, ref: torch.Tensor, tri: torch.Tensor) -> None:
    """Bit-identical, except that two NaNs (of two or more bytes) count as equal."""
    assert ref.shape == tri.shape, f"{name}: shape {tuple(ref.shape)} vs {tuple(tri.shape)}"
    assert ref.dtype == tri.dtype, f"{name}: dtype {ref.dtype} vs {tri.dtype}"
    int_dtype = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[ref.element_size()]
    a, b = ref.contiguous().view(int_dtype), tri.contiguous().view(int_dtype)
    bad = a != b
    if ref.is_floating_point() and ref.element_size() > 1:
        bad &= ~(ref.isnan() & tri.isnan())
    if bad.any():
        i = int(bad.flatten().nonzero()[0])
        raise AssertionError(
            f"{name}: {int(bad.sum())} of {bad.numel()} elements differ; first at flat index {i}: "
            f"ref {a.flatten()[i].item():#x} tri {b.flatten()[i].item():#x}"
        )


def check_row_format_impls_agree(
    x: torch.Tensor, quantize: Callable, dequantize: Callable, qdq: Callable, data_name: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """A row-block format's ops give the same bytes with impl="reference" and "triton": quantise, the fused
    qdq and dequantise to each output dtype. Returns the reference ``(data, scales)``."""
    data, scales = quantize(x, impl="reference")
    t_data, t_scales = quantize(x, impl="triton")
    assert_same_bytes(data_name, data, t_data)
    assert_same_bytes("scales", scales, t_scales)
    assert_same_bytes("qdq", qdq(x, impl="reference"), qdq(x, impl="triton"))
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        ref = dequantize(data, scales, dtype, impl="reference")
        assert_same_bytes(f"dequantize {dtype}", ref, dequantize(data, scales, dtype, impl="triton"))
    return data, scales


def u8(*shape: int) -> torch.Tensor:
    return torch.zeros(shape, dtype=torch.uint8)
