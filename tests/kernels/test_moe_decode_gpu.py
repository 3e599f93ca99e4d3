"""The grouped MoE GEMM's weight decoders on the GPU, exhaustively: every MXFP4 byte and every FP8 code under
every e8m0 scale byte.

``_decode_weights`` turns the raw bytes of one K step into bf16 weights with the scale folded in; both
decoders ("cvt": hardware fp8 conversions, "bits": integer ops and two bf16 FMAs per pair in inline PTX) must
give exactly the spec's values: ``dequantize_mxfp4`` (e2m1 * 2^(s - 127) has at most 2 significant bits, so
bf16 holds it exactly, subnormal results of scale bytes 0 and 1 included) and, for the shared expert's FP8
weights (32 x 32 blocks), ``dequantize_fp8_weight`` in bf16 (exact for scale bytes >= 4; below, bf16's
subnormals round it, the same way for both decoders); signed zeros kept, NaN codes and scale byte 255 NaN.
The CPU suite cannot run these (the interpreter has no inline PTX; it runs the fp32 bit decoder, which
the interpreted kernel tests cover). Tolerance: none (bit-equal after fp32 widening, NaN == NaN).
"""

import os

import pytest
import torch
import triton
import triton.language as tl

from flashtier.kernels.moe.grouped_gemm_kernel import DECODES, _decode_weights, _load_weights
from flashtier.kernels.quant.fp8_weight import dequantize_fp8_weight
from flashtier.kernels.quant.mxfp4 import dequantize_mxfp4

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="needs compiled Triton (inline PTX)"),
]


@triton.jit
def _decode_probe(p_wq, p_ws, p_even, p_odd, K, BN: tl.constexpr, BK: tl.constexpr, FP8_W: tl.constexpr,
                  DECODE: tl.constexpr):
    i_n, i_k = tl.program_id(0), tl.program_id(1)
    o_n = i_n * BN + tl.arange(0, BN)
    b_w, b_s = _load_weights(p_wq, p_ws, 0, 0, o_n, o_n >= 0, i_k * BK, K, True, FP8_W, BK)
    b_e, b_o = _decode_weights(b_w, b_s, FP8_W, BK, tl.bfloat16, DECODE)
    o_h = i_k * (BK // 2) + tl.arange(0, BK // 2)
    o = o_n.to(tl.int64)[:, None] * (K // 2) + o_h[None, :]
    tl.store(p_even + o, b_e.to(tl.float32))
    tl.store(p_odd + o, b_o.to(tl.float32))


def decode(codes: torch.Tensor, scales: torch.Tensor, how: str, fp8: bool = False, bn: int = 16,
           bk: int = 64) -> torch.Tensor:
    rows, k = codes.shape[0], codes.shape[1] * (1 if fp8 else 2)
    even = torch.empty(rows, k // 2, dtype=torch.float32, device=codes.device)
    odd = torch.empty_like(even)
    _decode_probe[(rows // bn, k // bk)](codes, scales, even, odd, k, BN=bn, BK=bk, FP8_W=fp8, DECODE=how)
    return torch.stack((even, odd), dim=-1).reshape(rows, k)


def every_byte_under_every_scale() -> tuple[torch.Tensor, torch.Tensor]:
    """Row r: scale byte r on all its 16 blocks, and all 256 code bytes (rotated by r, so each block sees a
    different mix): 65,536 (byte, scale) pairs, 131,072 elements."""
    r = torch.arange(256).view(-1, 1)
    codes = ((torch.arange(256).view(1, -1) + r) % 256).to(torch.uint8)
    scales = r.expand(256, 16).to(torch.uint8).contiguous()
    return codes.cuda(), scales.cuda()


def every_fp8_code_under_every_scale() -> tuple[torch.Tensor, torch.Tensor]:
    """256 rows x 1,024 codes (each row every code 4 times, rotated by the row) under 8 x 32 scale blocks holding
    the 256 scale bytes: every (code, scale) pair at least 32 times."""
    r = torch.arange(256).view(-1, 1)
    codes = ((torch.arange(1024).view(1, -1) + r) % 256).to(torch.uint8)
    scales = torch.arange(256).view(8, 32).to(torch.uint8)
    return codes.cuda(), scales.cuda()


def assert_bit_equal(out: torch.Tensor, ref: torch.Tensor) -> None:
    nan = torch.isnan(ref)
    assert torch.equal(torch.isnan(out), nan), "NaN where the spec has none, or a lost NaN"
    keep = ~nan
    assert torch.equal(out[keep], ref[keep]), f"{int((out[keep] != ref[keep]).sum())} values differ"
    assert torch.equal(torch.signbit(out[keep]), torch.signbit(ref[keep])), "a zero lost its sign"


@pytest.mark.parametrize("how", DECODES)
def test_every_mxfp4_byte_and_scale_decodes_exactly(how):
    codes, scales = every_byte_under_every_scale()
    ref = dequantize_mxfp4(codes, scales, impl="reference")
    assert_bit_equal(decode(codes, scales, how), ref)


@pytest.mark.parametrize("how", DECODES)
def test_every_fp8_code_and_scale_decodes_as_the_spec_in_bf16(how):
    codes, scales = every_fp8_code_under_every_scale()
    ref = dequantize_fp8_weight(codes, scales, impl="reference").to(torch.bfloat16).float()
    assert_bit_equal(decode(codes, scales, how, fp8=True), ref)


@pytest.mark.parametrize("how", DECODES)
def test_a_wrong_byte_or_scale_is_seen(how):
    """The check can fail: one flipped code bit, or one scale byte off by one, gives a different decode."""
    codes, scales = every_byte_under_every_scale()
    ref = dequantize_mxfp4(codes, scales, impl="reference")
    bad_codes = codes.clone()
    bad_codes[130, 7] ^= 0x10
    bad_scales = scales.clone()
    bad_scales[200, 3] += 1
    for c, s in ((bad_codes, scales), (codes, bad_scales)):
        with pytest.raises(AssertionError):
            assert_bit_equal(decode(c, s, how), ref)
