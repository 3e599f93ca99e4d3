"""Triton kernels shared by the two e2m1 formats: FP4 (``quant/fp4.py``) and MXFP4 (``quant/mxfp4.py``).

One quantise kernel and one dequantise kernel, specialised at compile time by two constexprs:

- ``BLOCK``: elements per scale (16 for FP4, 32 for MXFP4);
- ``E8M0``: the scale kind. False: a raw e4m3fn byte, s = e4m3(min(max(amax, 6 * 2^-9) / 6, 448)), and
  x / s is a correctly rounded division. True: an e8m0 byte, s = 2^ceil(log2(max(amax, 6 * 2^-126) / 6)),
  and x / s is a multiply by the exact reciprocal.

The specs are ``reference_quantize_e2m1`` / ``reference_dequantize_e2m1`` (``quant/e2m1.py``, with each
format's scale rule); e2m1 rounding, sign and packing are described there. :func:`e2m1_format` builds a
format's ops (a ``RowBlockFormat``) from both.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
import triton
import triton.language as tl

from flashtier.kernels.quant.e2m1 import (
    _e2m1_code,
    _e2m1_to_f32,
    _sign_bit,
    reference_dequantize_e2m1,
    reference_quantize_e2m1,
)
from flashtier.kernels.quant.fp8_bits import (
    _e4m3_code,
    _e4m3_to_f32,
    _e8m0_scale,
    _e8m0_to_f32,
    _f32_to_bf16_rne,
)
from flashtier.kernels.quant.common import RowBlockFormat, _row_block_offsets


@triton.jit
def _e2m1_scale_to_f32(b_sc, E8M0: tl.constexpr):
    """fp32 value of int32 scale bytes: 2^(b - 127) (e8m0) or e4m3(b)."""
    if E8M0:
        b_s = _e8m0_to_f32(b_sc)
    else:
        b_s = _e4m3_to_f32(b_sc)
    return b_s


@triton.jit
def _quantize_e2m1_kernel(
    p_x, p_packed, p_scales, p_out, n_groups,
    BLOCK: tl.constexpr, E8M0: tl.constexpr, BLOCK_G: tl.constexpr, QDQ: tl.constexpr,
):
    # One program quantises BLOCK_G consecutive BLOCK-element blocks of the flattened rows. Each block is read
    # contiguously and split into BLOCK / 2 even and BLOCK / 2 odd elements (the low and high nibbles of
    # BLOCK / 2 bytes). Traffic per block: read BLOCK inputs; write BLOCK / 2 + 1 bytes, or BLOCK fp32 (QDQ).
    HALF: tl.constexpr = BLOCK // 2
    o_g, o_x, m_g = _row_block_offsets(n_groups, BLOCK, BLOCK_G)
    o_p = o_g[:, None] * HALF + tl.arange(0, HALF)[None, :]
    m_p = m_g[:, None]
    b_x = tl.load(p_x + o_x, mask=m_p, other=0.0).to(tl.float32)
    b_lo, b_hi = tl.split(tl.reshape(b_x, (BLOCK_G, HALF, 2)))  # even / odd elements
    b_amax = tl.max(tl.abs(b_x), axis=1)
    if E8M0:
        b_amax = tl.maximum(b_amax, 7.052966104933725e-38)  # 6 * 2^-126, exact in fp32
        b_sc, b_inv = _e8m0_scale(b_amax, 6.0)  # a correctly rounded amax / 6 (div_rn)
        # x * 2^-k equals x / 2^k bit for bit (one rounding of the same value): no division needed here.
        c_lo = _e2m1_code(b_lo * b_inv[:, None], _sign_bit(b_lo))
        c_hi = _e2m1_code(b_hi * b_inv[:, None], _sign_bit(b_hi))
    else:
        b_amax = tl.maximum(b_amax, 0.01171875)  # 6 * 2^-9
        # div_rn everywhere a quotient is rounded: GPU fp32 `/` may be approximate.
        b_sc = _e4m3_code(tl.minimum(tl.math.div_rn(b_amax, tl.full([BLOCK_G], 6.0, tl.float32)), 448.0))
        b_s = tl.broadcast_to(_e4m3_to_f32(b_sc)[:, None], (BLOCK_G, HALF))
        c_lo = _e2m1_code(tl.math.div_rn(b_lo, b_s), _sign_bit(b_lo))
        c_hi = _e2m1_code(tl.math.div_rn(b_hi, b_s), _sign_bit(b_hi))
    if QDQ:
        b_s = _e2m1_scale_to_f32(b_sc, E8M0)[:, None]
        b_v = tl.join(_e2m1_to_f32(c_lo) * b_s, _e2m1_to_f32(c_hi) * b_s)  # re-interleave even / odd
        tl.store(p_out + o_x, tl.reshape(b_v, (BLOCK_G, BLOCK)), mask=m_p)
    else:
        tl.store(p_packed + o_p, (c_lo | (c_hi << 4)).to(tl.uint8), mask=m_p)
        tl.store(p_scales + o_g, b_sc.to(tl.uint8), mask=m_g)


@triton.jit
def _dequantize_e2m1_kernel(
    p_packed, p_scales, p_out, n_groups,
    BLOCK: tl.constexpr, E8M0: tl.constexpr, BLOCK_G: tl.constexpr, OUT_BF16: tl.constexpr,
):
    HALF: tl.constexpr = BLOCK // 2
    o_g, o_p, m_g = _row_block_offsets(n_groups, HALF, BLOCK_G)
    m_p = m_g[:, None]
    b_byte = tl.load(p_packed + o_p, mask=m_p, other=0).to(tl.int32)
    # Blocks past the end read the byte of scale 1.0 (e8m0 127, e4m3 0x38); their output is not stored.
    if E8M0:
        b_sc = tl.load(p_scales + o_g, mask=m_g, other=127).to(tl.int32)
    else:
        b_sc = tl.load(p_scales + o_g, mask=m_g, other=0x38).to(tl.int32)
    b_s = _e2m1_scale_to_f32(b_sc, E8M0)[:, None]
    b_v = tl.join(_e2m1_to_f32(b_byte & 0x0F) * b_s, _e2m1_to_f32(b_byte >> 4) * b_s)  # low nibble first
    b_v = tl.reshape(b_v, (BLOCK_G, BLOCK))
    if OUT_BF16:
        b_v = _f32_to_bf16_rne(b_v)
    o_x = o_g[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
    tl.store(p_out + o_x, b_v, mask=m_p)


def e2m1_format(
    name: str,
    block: int,
    e8m0: bool,
    amax_floor: float,
    scale_bytes: Callable[[torch.Tensor], torch.Tensor],
    scale_to_float: Callable[[torch.Tensor], torch.Tensor],
) -> RowBlockFormat:
    """The ops of one e2m1 format: its spec (``reference_*_e2m1`` of ``quant/e2m1.py`` with the format's
    ``block``, ``amax_floor`` and scale encoding) and the kernels above (``E8M0`` picks the scale kind)."""
    return RowBlockFormat(
        name,
        block,
        packed=True,
        reference_quantize=partial(
            reference_quantize_e2m1,
            block=block,
            amax_floor=amax_floor,
            scale_bytes=scale_bytes,
            scale_to_float=scale_to_float,
        ),
        reference_dequantize=partial(reference_dequantize_e2m1, block=block, scale_to_float=scale_to_float),
        quantize_kernel=_quantize_e2m1_kernel,
        dequantize_kernel=_dequantize_e2m1_kernel,
        constexprs={"BLOCK": block, "E8M0": e8m0},
    )
