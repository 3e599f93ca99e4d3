"""Window-KV FP8: e4m3fn values with one ue8m0 scale per 32 elements (the model's MXFP8-style act quant).

Per block of 32 consecutive elements of the last dimension:

    amax = max(max|x|, 1e-4)
    s    = 2^ceil(log2(amax / 448))       (a power of two; scale byte = its biased fp32 exponent, e8m0)
    q    = e4m3fn(clamp(x / s, -448, 448)) (round-to-nearest-even; code = the raw e4m3fn byte)

Byte layout of one vector of D elements (D % 32 == 0): ``codes uint8[D]`` then ``scales uint8[D // 32]``;
:func:`pack_fp8_record` concatenates them (D = 512 gives the 528-byte window-KV slot).
Non-finite inputs are outside the contract (their codes are unspecified). The Triton helpers
``_fp8_scale``, ``_fp8_codes`` and ``_fp8_values`` state this rule once for every FP8 kernel
(these rows, the 2-D weight blocks of ``quant/fp8_weight.py``, the MoE tiles).

Ops (``impl``: "auto" = Triton on CUDA, else the reference; "reference" or "triton"; both give identical bytes):

    quantize_fp8(x [..., D] fp32/bf16/fp16)       -> (codes uint8[..., D], scales uint8[..., D // 32]): raw
                                                     e4m3fn bytes, a scale byte b meaning 2^(b - 127)
    dequantize_fp8(codes, scales, dtype=fp32)     -> dtype [..., D]: e4m3(code) * 2^(scale - 127), exact in
                                                     fp32; bf16 / fp16 round to nearest even
    fp8_qdq(x)                                    -> dequantize_fp8(*quantize_fp8(x)) in fp32 (fused on GPU)
    pack_fp8_record / unpack_fp8_record(rec, D), FP8_RECORD_BYTES(D)

Example::

    codes, scales = quantize_fp8(torch.full((1, 32), 448.0))
    # codes[0, 0] == 0x7E (448), scales[0, 0] == 127 (s = 1)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashtier.kernels.quant.common import RowBlockFormat, _row_block_offsets
from flashtier.kernels.quant.fp8_bits import (
    E4M3_MAX,
    _e4m3_code,
    _e4m3_to_f32,
    _e8m0_scale,
    _e8m0_to_f32,
    _f32_to_bf16_rne,
    e4m3_bytes,
    e4m3_to_float,
    e8m0_scale_bytes,
    e8m0_to_float,
)

FP8_BLOCK = 32
FP8_AMAX_FLOOR = 1e-4


def reference_fp8_blocks(blocks: torch.Tensor, dims: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """The rule in plain torch: ``(codes uint8, scales uint8)`` of fp32 ``blocks`` whose axes ``dims`` span a block.

    ``codes`` has the shape of ``blocks``; ``scales`` that shape without ``dims``. Rounding: ``amax / 448`` is
    one correctly rounded fp32 division, then rounded UP to a power of two with the exponent bit trick (so
    |x / s| <= 448 and the scale never clips the block's largest element); ``x / s`` is exact (s is a power
    of two; only fp32 subnormals round); the e4m3 cast rounds to nearest even.
    """
    q, scales, _ = _scaled_blocks(blocks, dims)
    return e4m3_bytes(q), scales.squeeze(dims)


def _scaled_blocks(blocks: torch.Tensor, dims: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(x / s clamped to +-448, scale bytes, s)`` of fp32 ``blocks``, the scales kept in ``dims``."""
    amax = blocks.abs().amax(dim=dims, keepdim=True).clamp_min(FP8_AMAX_FLOOR)
    scales = e8m0_scale_bytes(amax, E4M3_MAX)
    scale = e8m0_to_float(scales)
    return (blocks / scale).clamp(-E4M3_MAX, E4M3_MAX), scales, scale


def _reference_quantize_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The spec, in plain torch: ``x [R, D]`` -> ``(codes uint8[R, D], scales uint8[R, D // 32])``."""
    r, d = x.shape
    codes, scales = reference_fp8_blocks(x.to(torch.float32).reshape(r, d // FP8_BLOCK, FP8_BLOCK), (-1,))
    return codes.reshape(r, d), scales


def _reference_dequantize_fp8(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The spec of decoding: ``e4m3(code) * 2^(scale - 127)`` in fp32, then cast to ``dtype``."""
    r, d = codes.shape
    values = e4m3_to_float(codes).reshape(r, d // FP8_BLOCK, FP8_BLOCK) * e8m0_to_float(scales).unsqueeze(-1)
    return values.reshape(r, d).to(dtype)


def _reference_qdq_fp8(x: torch.Tensor) -> torch.Tensor:
    """``_reference_dequantize_fp8(*_reference_quantize_fp8(x), float32)`` without the bytes in between, bit for
    bit (tests/kernels/test_quant_fp8.py holds it to that over normal, tiny, huge, zero and non-finite blocks):
    the same amax, the same correctly rounded ``amax / 448``, the same scale byte (``to(uint8)`` wraps a NaN
    block's 256 to 0, as the bytes path does), decoded once instead of twice, and the e4m3 cast read back
    directly. The CPU engine runs this round trip on every FP8 linear's input: about half its cost went to
    the byte views and the second decode."""
    r, d = x.shape
    q, _, scale = _scaled_blocks(x.to(torch.float32).reshape(r, d // FP8_BLOCK, FP8_BLOCK), (-1,))
    return (q.to(torch.float8_e4m3fn).to(torch.float32) * scale).reshape(r, d)


@triton.jit
def _fp8_scale(b_amax):
    """``(int32 e8m0 byte, exact fp32 reciprocal)`` of a block's scale 2^ceil(log2(max(amax, 1e-4) / 448)),
    from fp32 ``b_amax = max|x|`` (a correctly rounded amax / 448: div_rn)."""
    return _e8m0_scale(tl.maximum(b_amax, 1e-4), 448.0)


@triton.jit
def _fp8_codes(b_x, b_inv):
    """int32 e4m3 codes of fp32 ``b_x / s``, clamped to +-448; ``b_inv`` = 1 / s, broadcast to ``b_x``."""
    # x * 2^-k equals x / 2^k bit for bit (one rounding of the same value): no division needed here.
    return _e4m3_code(tl.minimum(tl.maximum(b_x * b_inv, -448.0), 448.0))


@triton.jit
def _fp8_values(b_code, b_exp, OUT_BF16: tl.constexpr):
    """e4m3(code) * 2^(b_exp - 127), exact in fp32, rounded to bf16 (RNE) when ``OUT_BF16`` (``b_exp`` broadcast)."""
    b_v = _e4m3_to_f32(b_code) * _e8m0_to_f32(b_exp)
    if OUT_BF16:
        b_v = _f32_to_bf16_rne(b_v)
    return b_v


@triton.jit
def _quantize_fp8_kernel(p_x, p_codes, p_scales, p_out, n_groups, BLOCK_G: tl.constexpr, QDQ: tl.constexpr):
    # One program quantises BLOCK_G consecutive 32-element blocks of the flattened rows (D % 32 == 0, so a
    # block never straddles two rows). Traffic per block: read 32 inputs; write 32 + 1 bytes, or 32 fp32 (QDQ).
    o_g, o_x, m_g = _row_block_offsets(n_groups, 32, BLOCK_G)
    b_x = tl.load(p_x + o_x, mask=m_g[:, None], other=0.0).to(tl.float32)
    b_exp, b_inv = _fp8_scale(tl.max(tl.abs(b_x), axis=1))
    b_code = _fp8_codes(b_x, b_inv[:, None])
    if QDQ:
        tl.store(p_out + o_x, _fp8_values(b_code, b_exp[:, None], False), mask=m_g[:, None])
    else:
        tl.store(p_codes + o_x, b_code.to(tl.uint8), mask=m_g[:, None])
        tl.store(p_scales + o_g, b_exp.to(tl.uint8), mask=m_g)


@triton.jit
def _dequantize_fp8_kernel(p_codes, p_scales, p_out, n_groups, BLOCK_G: tl.constexpr, OUT_BF16: tl.constexpr):
    o_g, o_x, m_g = _row_block_offsets(n_groups, 32, BLOCK_G)
    b_code = tl.load(p_codes + o_x, mask=m_g[:, None], other=0).to(tl.int32)
    b_exp = tl.load(p_scales + o_g, mask=m_g, other=127).to(tl.int32)
    tl.store(p_out + o_x, _fp8_values(b_code, b_exp[:, None], OUT_BF16), mask=m_g[:, None])


FP8 = RowBlockFormat(
    "fp8",
    FP8_BLOCK,
    packed=False,
    reference_quantize=_reference_quantize_fp8,
    reference_dequantize=_reference_dequantize_fp8,
    reference_qdq=_reference_qdq_fp8,
    quantize_kernel=_quantize_fp8_kernel,
    dequantize_kernel=_dequantize_fp8_kernel,
)


# The public ops: ``RowBlockFormat``'s methods (``quant/common.py``), named ``*_fp8*`` in their errors.
quantize_fp8, dequantize_fp8, fp8_qdq, pack_fp8_record, unpack_fp8_record, FP8_RECORD_BYTES = FP8.ops()
