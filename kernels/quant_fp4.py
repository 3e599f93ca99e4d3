"""Main-KV FP4: e2m1 values with one e4m3fn scale per 16 elements (NVFP4 without a global scale).

Per block of 16 consecutive elements of the last dimension:

    amax = max|x|
    s    = e4m3fn(min(max(amax, 6 * 2^-9) / 6, 448))   (RNE to e4m3, NOT a power of two; scale byte = raw e4m3)
    q    = e2m1_rne(x / float(s))                        (ties to the even code, saturating at +-6)

The floor 6 * 2^-9 keeps s >= 2^-9, the smallest e4m3 subnormal, so s is never 0. The clamp at 448 (a choice
made here; torch's e4m3 cast also saturates) caps s for amax > 2688 = 448 * 6, the format's largest magnitude:
such blocks saturate at +-6 * 448. e2m1 rounding, sign and nibble packing are described in ``_e2m1.py``.

Byte layout of one vector of D elements (D % 16 == 0): ``packed uint8[D // 2]`` (element 2i in the low
nibble of byte i, 2i + 1 in the high nibble) then ``scales uint8[D // 16]`` (raw e4m3 bytes);
:func:`pack_fp4_record` concatenates them (D = 512 gives 256 + 32 = 288 bytes, the main-KV entry).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashtier.kernels._e2m1 import _e2m1_code, _e2m1_to_f32, e2m1_codes, e2m1_to_float, pack_nibbles, unpack_nibbles
from flashtier.kernels._fp8_bits import E4M3_MAX, _e4m3_code, _e4m3_to_f32, _f32_to_bf16_rne, e4m3_bytes, e4m3_to_float
from flashtier.kernels._quant_common import (
    as_rows,
    check_byte_tensor,
    check_float_input,
    check_last_dim,
    check_out_dtype,
    check_record,
    check_same_device,
    resolve_impl,
)

FP4_BLOCK = 16
FP4_AMAX_FLOOR = 6 * 2**-9  # amax floor: s = e4m3(amax / 6) >= 2^-9
_BLOCK_G = 128  # blocks of 16 per Triton program (2048 elements)


def FP4_RECORD_BYTES(D: int) -> int:  # noqa: N802 (named like the constant it stands for)
    """Bytes of one packed FP4 record for ``D`` elements: D // 2 code bytes + D // 16 scale bytes."""
    if D <= 0 or D % FP4_BLOCK != 0:
        raise ValueError(f"FP4_RECORD_BYTES: D must be a positive multiple of {FP4_BLOCK}, got {D}")
    return D // 2 + D // FP4_BLOCK


def quantize_fp4(x: torch.Tensor, impl: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise ``x [..., D]`` (fp32/bf16/fp16, D % 16 == 0) to packed e2m1 with e4m3 scales per 16.

    Returns ``(packed uint8[..., D // 2], scales uint8[..., D // 16])``. ``impl``: "auto" (triton on CUDA,
    else reference), "reference" or "triton"; both give identical bytes.

    Example::

        packed, scales = quantize_fp4(torch.tensor([[0.0, 0.5, 1, 1.5, 2, 3, 4, 6] * 2]))
        # scales[0, 0] == 0x38 (e4m3 1.0); packed[0, :4] == [0x10, 0x32, 0x54, 0x76]
    """
    check_float_input(x, "x", "quantize_fp4", FP4_BLOCK)
    impl = resolve_impl(impl, x, "quantize_fp4")
    d = x.shape[-1]
    fn = _reference_quantize_fp4 if impl == "reference" else _triton_quantize_fp4
    packed, scales = fn(as_rows(x))
    return packed.reshape(*x.shape[:-1], d // 2), scales.reshape(*x.shape[:-1], d // FP4_BLOCK)


def dequantize_fp4(
    packed: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32, impl: str = "auto"
) -> torch.Tensor:
    """Decode ``packed uint8[..., D // 2]`` with ``scales uint8[..., D // 16]`` to ``dtype [..., D]``.

    Each value is e2m1(code) * e4m3(scale): at most 6 significant bits, so exact in fp32, bf16 and fp16
    (within their ranges).
    """
    half = check_last_dim(packed, "packed", "dequantize_fp4", FP4_BLOCK // 2)
    check_byte_tensor(packed, "packed", "dequantize_fp4", half, packed.shape[:-1])
    check_byte_tensor(scales, "scales", "dequantize_fp4", half * 2 // FP4_BLOCK, packed.shape[:-1])
    check_same_device(packed, scales, "packed and scales", "dequantize_fp4")
    check_out_dtype(dtype, "dequantize_fp4")
    impl = resolve_impl(impl, packed, "dequantize_fp4")
    fn = _reference_dequantize_fp4 if impl == "reference" else _triton_dequantize_fp4
    return fn(as_rows(packed), as_rows(scales), dtype).reshape(*packed.shape[:-1], half * 2)


def fp4_qdq(x: torch.Tensor, impl: str = "auto") -> torch.Tensor:
    """``dequantize_fp4(*quantize_fp4(x))`` in fp32: the model's in-line fake quantisation (fused on GPU)."""
    check_float_input(x, "x", "fp4_qdq", FP4_BLOCK)
    impl = resolve_impl(impl, x, "fp4_qdq")
    rows = as_rows(x)
    if impl == "reference":
        return _reference_dequantize_fp4(*_reference_quantize_fp4(rows), torch.float32).reshape(x.shape)
    return _triton_fp4_qdq(rows).reshape(x.shape)


def pack_fp4_record(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``packed uint8[..., D // 2]`` + ``scales uint8[..., D // 16]`` -> ``uint8[..., D // 2 + D // 16]``."""
    half = check_last_dim(packed, "packed", "pack_fp4_record", FP4_BLOCK // 2)
    check_byte_tensor(packed, "packed", "pack_fp4_record", half, packed.shape[:-1])
    check_byte_tensor(scales, "scales", "pack_fp4_record", half * 2 // FP4_BLOCK, packed.shape[:-1])
    return torch.cat((packed, scales), dim=-1)


def unpack_fp4_record(rec: torch.Tensor, D: int) -> tuple[torch.Tensor, torch.Tensor]:  # noqa: N803
    """Split ``rec uint8[..., D // 2 + D // 16]`` into ``(packed, scales)`` (views of ``rec``)."""
    check_record(rec, D, FP4_BLOCK, D // 2, D // FP4_BLOCK, "unpack_fp4_record")
    return rec[..., : D // 2], rec[..., D // 2 :]


def _reference_quantize_fp4(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The spec, in plain torch: ``x [R, D]`` -> ``(packed uint8[R, D // 2], scales uint8[R, D // 16])``.

    Rounding: ``max(amax, 6 * 2^-9) / 6`` is one correctly rounded fp32 division, cast to e4m3 with RNE
    (so s may round below amax / 6 and a block's largest element may saturate at 6); ``x / s`` is one
    correctly rounded fp32 division; e2m1 rounds to nearest, ties to the even code.
    """
    r, d = x.shape
    blocks = x.to(torch.float32).reshape(r, d // FP4_BLOCK, FP4_BLOCK)
    amax = blocks.abs().amax(dim=-1).clamp_min(FP4_AMAX_FLOOR)
    # Divide by tensors, not Python scalars: CUDA torch turns `t / 6.0` into `t * (1 / 6)`.
    scales = e4m3_bytes((amax / torch.full_like(amax, 6.0)).clamp_max(E4M3_MAX))
    q = blocks / e4m3_to_float(scales).unsqueeze(-1)
    codes = e2m1_codes(q, blocks < 0).reshape(r, d)
    return pack_nibbles(codes), scales


def _reference_dequantize_fp4(packed: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The spec of decoding: ``e2m1(code) * e4m3(scale)`` in fp32, then cast to ``dtype``."""
    r, half = packed.shape
    values = e2m1_to_float(unpack_nibbles(packed)).reshape(r, scales.shape[-1], FP4_BLOCK) * e4m3_to_float(scales).unsqueeze(-1)
    return values.reshape(r, half * 2).to(dtype)


@triton.jit
def _quantize_fp4_kernel(p_x, p_packed, p_scales, p_out, n_groups, BLOCK_G: tl.constexpr, QDQ: tl.constexpr):
    # One program quantises BLOCK_G consecutive 16-element blocks of the flattened rows. Each block is read
    # contiguously and split into 8 even and 8 odd elements (the low and high nibbles of 8 bytes).
    # Traffic per block: read 16 inputs; write 8 + 1 bytes, or 16 fp32 (QDQ).
    i_g = tl.program_id(0).to(tl.int64) * BLOCK_G
    o_g = i_g + tl.arange(0, BLOCK_G)
    o_x = o_g[:, None] * 16 + tl.arange(0, 16)[None, :]
    o_p = o_g[:, None] * 8 + tl.arange(0, 8)[None, :]
    m_g = o_g < n_groups
    m_p = m_g[:, None]
    b_x = tl.load(p_x + o_x, mask=m_p, other=0.0).to(tl.float32)
    b_lo, b_hi = tl.split(tl.reshape(b_x, (BLOCK_G, 8, 2)))  # even / odd elements
    b_amax = tl.max(tl.abs(b_x), axis=1)
    b_amax = tl.maximum(b_amax, 0.01171875)  # 6 * 2^-9
    # div_rn everywhere a quotient is rounded: GPU fp32 `/` may be approximate.
    b_sc = _e4m3_code(tl.minimum(tl.math.div_rn(b_amax, tl.full([BLOCK_G], 6.0, tl.float32)), 448.0))
    b_s = tl.broadcast_to(_e4m3_to_f32(b_sc)[:, None], (BLOCK_G, 8))
    c_lo = _e2m1_code(tl.math.div_rn(b_lo, b_s), b_lo < 0)
    c_hi = _e2m1_code(tl.math.div_rn(b_hi, b_s), b_hi < 0)
    if QDQ:
        b_v = tl.join(_e2m1_to_f32(c_lo) * b_s, _e2m1_to_f32(c_hi) * b_s)  # re-interleave even / odd
        tl.store(p_out + o_x, tl.reshape(b_v, (BLOCK_G, 16)), mask=m_p)
    else:
        tl.store(p_packed + o_p, (c_lo | (c_hi << 4)).to(tl.uint8), mask=m_p)
        tl.store(p_scales + o_g, b_sc.to(tl.uint8), mask=m_g)


@triton.jit
def _dequantize_fp4_kernel(p_packed, p_scales, p_out, n_groups, BLOCK_G: tl.constexpr, OUT_BF16: tl.constexpr):
    i_g = tl.program_id(0).to(tl.int64) * BLOCK_G
    o_g = i_g + tl.arange(0, BLOCK_G)
    o_p = o_g[:, None] * 8 + tl.arange(0, 8)[None, :]
    m_g = o_g < n_groups
    m_p = m_g[:, None]
    b_byte = tl.load(p_packed + o_p, mask=m_p, other=0).to(tl.int32)
    b_s = _e4m3_to_f32(tl.load(p_scales + o_g, mask=m_g, other=0x38).to(tl.int32))[:, None]
    b_v = tl.join(_e2m1_to_f32(b_byte & 0x0F) * b_s, _e2m1_to_f32(b_byte >> 4) * b_s)  # low nibble first
    b_v = tl.reshape(b_v, (BLOCK_G, 16))
    if OUT_BF16:
        b_v = _f32_to_bf16_rne(b_v)
    o_x = o_g[:, None] * 16 + tl.arange(0, 16)[None, :]
    tl.store(p_out + o_x, b_v, mask=m_p)


def _triton_quantize_fp4(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    r, d = x.shape
    packed = torch.empty((r, d // 2), dtype=torch.uint8, device=x.device)
    scales = torch.empty((r, d // FP4_BLOCK), dtype=torch.uint8, device=x.device)
    n_groups = r * (d // FP4_BLOCK)
    if n_groups:
        grid = (triton.cdiv(n_groups, _BLOCK_G),)
        _quantize_fp4_kernel[grid](x, packed, scales, packed, n_groups, BLOCK_G=_BLOCK_G, QDQ=False)
    return packed, scales


def _triton_fp4_qdq(x: torch.Tensor) -> torch.Tensor:
    r, d = x.shape
    out = torch.empty((r, d), dtype=torch.float32, device=x.device)
    n_groups = r * (d // FP4_BLOCK)
    if n_groups:
        grid = (triton.cdiv(n_groups, _BLOCK_G),)
        _quantize_fp4_kernel[grid](x, out, out, out, n_groups, BLOCK_G=_BLOCK_G, QDQ=True)
    return out


def _triton_dequantize_fp4(packed: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    r, half = packed.shape
    out = torch.empty((r, half * 2), dtype=dtype, device=packed.device)
    n_groups = r * (half * 2 // FP4_BLOCK)
    if n_groups:
        grid = (triton.cdiv(n_groups, _BLOCK_G),)
        _dequantize_fp4_kernel[grid](
            packed, scales, out, n_groups, BLOCK_G=_BLOCK_G, OUT_BF16=dtype == torch.bfloat16
        )
    return out
