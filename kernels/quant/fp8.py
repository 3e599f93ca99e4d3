"""Window-KV FP8: e4m3fn values with one ue8m0 scale per 32 elements (the model's MXFP8-style act quant).

Per block of 32 consecutive elements of the last dimension:

    amax = max(max|x|, 1e-4)
    s    = 2^ceil(log2(amax / 448))       (a power of two; scale byte = its biased fp32 exponent, e8m0)
    q    = e4m3fn(clamp(x / s, -448, 448)) (round-to-nearest-even; code = the raw e4m3fn byte)

Byte layout of one vector of D elements (D % 32 == 0): ``codes uint8[D]`` then ``scales uint8[D // 32]``;
:func:`pack_fp8_record` concatenates them (D = 512 gives the 528-byte window-KV slot).
Non-finite inputs are outside the contract (their codes are unspecified).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashtier.kernels.quant.fp8_bits import (
    E4M3_MAX,
    _e4m3_code,
    _e4m3_to_f32,
    _e8m0_reciprocal,
    _e8m0_scale_exponent,
    _e8m0_to_f32,
    _f32_to_bf16_rne,
    e4m3_bytes,
    e4m3_to_float,
    e8m0_scale_bytes,
    e8m0_to_float,
)
from flashtier.kernels.quant.common import (
    _row_block_offsets,
    as_rows,
    check_byte_tensor,
    check_float_input,
    check_last_dim,
    check_out_dtype,
    check_record,
    check_same_device,
    resolve_impl,
    triton_dequantize_rows,
    triton_qdq_rows,
    triton_quantize_rows,
)

FP8_BLOCK = 32
FP8_AMAX_FLOOR = 1e-4


def FP8_RECORD_BYTES(D: int) -> int:  # noqa: N802 (named like the constant it stands for)
    """Bytes of one packed FP8 record for a vector of ``D`` elements: D code bytes + D // 32 scale bytes."""
    if D <= 0 or D % FP8_BLOCK != 0:
        raise ValueError(f"FP8_RECORD_BYTES: D must be a positive multiple of {FP8_BLOCK}, got {D}")
    return D + D // FP8_BLOCK


def quantize_fp8(x: torch.Tensor, impl: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise ``x [..., D]`` (fp32/bf16/fp16, D % 32 == 0) to e4m3fn codes with ue8m0 scales per 32.

    Returns ``(codes uint8[..., D], scales uint8[..., D // 32])``: codes are raw e4m3fn bytes, a scale byte b
    means 2^(b - 127). ``impl``: "auto" (triton on CUDA, else reference), "reference" or "triton"; both
    give identical bytes.

    Example::

        codes, scales = quantize_fp8(torch.full((1, 32), 448.0))
        # codes[0, 0] == 0x7E (448), scales[0, 0] == 127 (s = 1)
    """
    check_float_input(x, "x", "quantize_fp8", FP8_BLOCK)
    impl = resolve_impl(impl, x, "quantize_fp8")
    d = x.shape[-1]
    rows = as_rows(x)
    fn = _reference_quantize_fp8 if impl == "reference" else _triton_quantize_fp8
    codes, scales = fn(rows)
    return codes.reshape(x.shape), scales.reshape(*x.shape[:-1], d // FP8_BLOCK)


def dequantize_fp8(
    codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32, impl: str = "auto"
) -> torch.Tensor:
    """Decode ``codes uint8[..., D]`` with ``scales uint8[..., D // 32]`` to ``dtype [..., D]``.

    Each value is e4m3(code) * 2^(scale - 127), exact in fp32; the cast to bf16/fp16 rounds to nearest even.
    """
    d = check_last_dim(codes, "codes", "dequantize_fp8", FP8_BLOCK)
    check_byte_tensor(codes, "codes", "dequantize_fp8", d, codes.shape[:-1])
    check_byte_tensor(scales, "scales", "dequantize_fp8", d // FP8_BLOCK, codes.shape[:-1])
    check_same_device(codes, scales, "codes and scales", "dequantize_fp8")
    check_out_dtype(dtype, "dequantize_fp8")
    impl = resolve_impl(impl, codes, "dequantize_fp8")
    fn = _reference_dequantize_fp8 if impl == "reference" else _triton_dequantize_fp8
    return fn(as_rows(codes), as_rows(scales), dtype).reshape(codes.shape)


def fp8_qdq(x: torch.Tensor, impl: str = "auto") -> torch.Tensor:
    """``dequantize_fp8(*quantize_fp8(x))`` in fp32: the model's in-line fake quantisation (fused on GPU)."""
    check_float_input(x, "x", "fp8_qdq", FP8_BLOCK)
    impl = resolve_impl(impl, x, "fp8_qdq")
    rows = as_rows(x)
    if impl == "reference":
        return _reference_dequantize_fp8(*_reference_quantize_fp8(rows), torch.float32).reshape(x.shape)
    return _triton_fp8_qdq(rows).reshape(x.shape)


def pack_fp8_record(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``codes uint8[..., D]`` + ``scales uint8[..., D // 32]`` -> ``uint8[..., D + D // 32]`` (data, then scales)."""
    d = check_last_dim(codes, "codes", "pack_fp8_record", FP8_BLOCK)
    check_byte_tensor(codes, "codes", "pack_fp8_record", d, codes.shape[:-1])
    check_byte_tensor(scales, "scales", "pack_fp8_record", d // FP8_BLOCK, codes.shape[:-1])
    return torch.cat((codes, scales), dim=-1)


def unpack_fp8_record(rec: torch.Tensor, D: int) -> tuple[torch.Tensor, torch.Tensor]:  # noqa: N803
    """Split ``rec uint8[..., D + D // 32]`` into ``(codes [..., D], scales [..., D // 32])`` (views of ``rec``)."""
    check_record(rec, D, FP8_BLOCK, D, D // FP8_BLOCK, "unpack_fp8_record")
    return rec[..., :D], rec[..., D:]


def _reference_quantize_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The spec, in plain torch: ``x [R, D]`` -> ``(codes uint8[R, D], scales uint8[R, D // 32])``.

    Rounding: ``amax / 448`` is one correctly rounded fp32 division, then rounded UP to a power of two
    with the exponent bit trick (so |x / s| <= 448 and the scale never clips the block's largest element);
    ``x / s`` is exact (s is a power of two; only fp32 subnormals round); the e4m3 cast rounds to nearest even.
    """
    r, d = x.shape
    blocks = x.to(torch.float32).reshape(r, d // FP8_BLOCK, FP8_BLOCK)
    amax = blocks.abs().amax(dim=-1).clamp_min(FP8_AMAX_FLOOR)
    scales = e8m0_scale_bytes(amax, E4M3_MAX)
    q = (blocks / e8m0_to_float(scales).unsqueeze(-1)).clamp(-E4M3_MAX, E4M3_MAX)
    return e4m3_bytes(q).reshape(r, d), scales


def _reference_dequantize_fp8(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The spec of decoding: ``e4m3(code) * 2^(scale - 127)`` in fp32, then cast to ``dtype``."""
    r, d = codes.shape
    values = e4m3_to_float(codes).reshape(r, d // FP8_BLOCK, FP8_BLOCK) * e8m0_to_float(scales).unsqueeze(-1)
    return values.reshape(r, d).to(dtype)


@triton.jit
def _quantize_fp8_kernel(p_x, p_codes, p_scales, p_out, n_groups, BLOCK_G: tl.constexpr, QDQ: tl.constexpr):
    # One program quantises BLOCK_G consecutive 32-element blocks of the flattened rows (D % 32 == 0, so a
    # block never straddles two rows). Traffic per block: read 32 inputs; write 32 + 1 bytes, or 32 fp32 (QDQ).
    o_g, o_x, m_g = _row_block_offsets(n_groups, 32, BLOCK_G)
    b_x = tl.load(p_x + o_x, mask=m_g[:, None], other=0.0).to(tl.float32)
    b_amax = tl.maximum(tl.max(tl.abs(b_x), axis=1), 1e-4)
    b_exp = _e8m0_scale_exponent(b_amax, 448.0)  # a correctly rounded amax / 448 (div_rn)
    # x * 2^-k equals x / 2^k bit for bit (one rounding of the same value): no division needed here.
    b_q = b_x * _e8m0_reciprocal(b_exp)[:, None]
    b_code = _e4m3_code(tl.minimum(tl.maximum(b_q, -448.0), 448.0))
    if QDQ:
        tl.store(p_out + o_x, _e4m3_to_f32(b_code) * _e8m0_to_f32(b_exp)[:, None], mask=m_g[:, None])
    else:
        tl.store(p_codes + o_x, b_code.to(tl.uint8), mask=m_g[:, None])
        tl.store(p_scales + o_g, b_exp.to(tl.uint8), mask=m_g)


@triton.jit
def _dequantize_fp8_kernel(p_codes, p_scales, p_out, n_groups, BLOCK_G: tl.constexpr, OUT_BF16: tl.constexpr):
    o_g, o_x, m_g = _row_block_offsets(n_groups, 32, BLOCK_G)
    b_code = tl.load(p_codes + o_x, mask=m_g[:, None], other=0).to(tl.int32)
    b_exp = tl.load(p_scales + o_g, mask=m_g, other=127).to(tl.int32)
    b_v = _e4m3_to_f32(b_code) * _e8m0_to_f32(b_exp)[:, None]
    if OUT_BF16:
        b_v = _f32_to_bf16_rne(b_v)
    tl.store(p_out + o_x, b_v, mask=m_g[:, None])


def _triton_quantize_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return triton_quantize_rows(_quantize_fp8_kernel, x, FP8_BLOCK, x.shape[1])


def _triton_fp8_qdq(x: torch.Tensor) -> torch.Tensor:
    return triton_qdq_rows(_quantize_fp8_kernel, x, FP8_BLOCK)


def _triton_dequantize_fp8(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return triton_dequantize_rows(_dequantize_fp8_kernel, codes, scales, codes.shape[1], dtype, FP8_BLOCK)
