"""Quantisation ops on a real GPU: compiled Triton on CUDA vs the reference on CPU, byte for byte.

Opt-in (``-m gpu``); it needs CUDA and TRITON_INTERPRET=0 (tests/conftest.py defaults it to 1). CI has no
GPU, so these are skipped there; the interpreted Triton tests cover the same kernels on CPU.
"""

import os

import pytest
import torch

from flashtier.kernels.quant.fp8_weight import as_raw_bytes, dequantize_fp8_weight, quantize_fp8_weight
from flashtier.kernels.quant.fp4 import dequantize_fp4, fp4_qdq, quantize_fp4
from flashtier.kernels.quant.fp8 import dequantize_fp8, fp8_qdq, quantize_fp8
from flashtier.kernels.quant.mxfp4 import dequantize_mxfp4, mxfp4_qdq, quantize_mxfp4

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="needs compiled Triton (TRITON_INTERPRET=0)"),
]

OPS = {
    "fp8": (quantize_fp8, dequantize_fp8, fp8_qdq),
    "fp4": (quantize_fp4, dequantize_fp4, fp4_qdq),
    "mxfp4": (quantize_mxfp4, dequantize_mxfp4, mxfp4_qdq),
}


def assert_same_bits(name: str, ref: torch.Tensor, out: torch.Tensor) -> None:
    ref, out = ref.cpu().contiguous(), out.cpu().contiguous()
    assert ref.shape == out.shape and ref.dtype == out.dtype, name
    int_dtype = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[ref.element_size()]
    bad = ref.view(int_dtype) != out.view(int_dtype)
    if ref.is_floating_point():
        bad &= ~(ref.isnan() & out.isnan())
    assert not bad.any(), f"{name}: {int(bad.sum())} of {bad.numel()} elements differ"


def inputs() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    ties = torch.tensor([6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0] * 4)
    return {
        "randn_1": torch.randn(4096, 512, generator=g),
        "randn_1e-6": torch.randn(130, 512, generator=g) * 1e-6,
        "randn_1e3": torch.randn(130, 512, generator=g) * 1e3,
        "wide": torch.randn(1024, 512, generator=g) * torch.exp2(torch.randint(-100, 100, (1024, 1), generator=g)),
        "ties": (ties * torch.exp2(torch.arange(-20, 20).float())[:, None]).repeat(1, 16),
        "zeros": torch.zeros(17, 512),
        "neg": -torch.rand(17, 512, generator=g) * 1e-3,
        "signed_zeros": torch.randn(17, 512, generator=g).masked_fill(torch.arange(512) % 3 == 0, -0.0),
        "bf16": torch.randn(300, 512, generator=g).to(torch.bfloat16),
    }


@pytest.mark.parametrize("op", list(OPS))
@pytest.mark.parametrize("name", list(inputs()))
def test_cuda_triton_matches_cpu_reference(op, name):
    quantize, dequantize, qdq = OPS[op]
    x = inputs()[name]
    ref = quantize(x, impl="reference")
    for impl in ("triton", "reference"):  # the reference on CUDA must give the same bytes as on CPU
        out = quantize(x.cuda(), impl=impl)
        assert_same_bits(f"{op} {impl} data", ref[0], out[0])
        assert_same_bits(f"{op} {impl} scales", ref[1], out[1])
        assert_same_bits(f"{op} {impl} qdq", qdq(x, impl="reference"), qdq(x.cuda(), impl=impl))
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            expect = dequantize(*ref, dtype, impl="reference")
            out = dequantize(ref[0].cuda(), ref[1].cuda(), dtype, impl=impl)
            assert_same_bits(f"{op} {impl} dequantize {dtype}", expect, out)


@pytest.mark.parametrize("block", [(32, 32), (1, 32), (128, 128)])
def test_cuda_fp8_weight_matches_cpu_reference(block):
    g = torch.Generator().manual_seed(1)
    w = torch.randn(1000, 777, generator=g) * torch.exp2(torch.randint(-30, 30, (1000, 1), generator=g).float())
    q, s = quantize_fp8_weight(w, block, impl="reference")
    for impl in ("triton", "reference"):
        tq, ts = quantize_fp8_weight(w.cuda(), block, impl=impl)
        assert_same_bits(f"{impl} q", as_raw_bytes(q), as_raw_bytes(tq))
        assert_same_bits(f"{impl} scale", as_raw_bytes(s), as_raw_bytes(ts))
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            expect = dequantize_fp8_weight(q, s, block, dtype, impl="reference")
            out = dequantize_fp8_weight(q.cuda(), s.cuda(), block, dtype, impl=impl)
            assert_same_bits(f"{impl} dequantize {dtype}", expect, out)
