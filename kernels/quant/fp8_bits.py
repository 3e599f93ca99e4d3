"""Bit-level helpers for e4m3fn values and e8m0 (ue8m0) scales, in torch and in Triton.

Formats:
- e4m3fn: 1 sign bit, 4 exponent bits (bias 7), 3 mantissa bits; no infinities; 0x7F/0xFF are NaN;
  largest finite 448 (0x7E), smallest normal 2^-6 (0x08), subnormals are multiples of 2^-9.
- e8m0 (ue8m0): one unsigned byte b meaning 2^(b - 127); 0xFF is NaN. For a power of two in fp32's normal
  range, b is the biased fp32 exponent, so the byte can be read off the fp32 bits.

The Triton helpers work on integer bit patterns only (no float conversions). That keeps the kernels
byte-identical to torch on every backend: Triton's CPU interpreter rounds fp32 -> fp8 half-away-from-zero
and decodes e4m3 NaN as 480, and integer code has no rounding-mode or FMA-contraction questions on GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

E4M3_MAX = 448.0


def e8m0_scale_bytes(amax: torch.Tensor, qmax: float) -> torch.Tensor:
    """e8m0 bytes (uint8) of ``s = 2^ceil(log2(amax / qmax))`` for positive normal fp32 ``amax``: the smallest
    power of two with ``amax / s <= qmax``, up to the rounding of the quotient.

    ``amax / qmax`` is one correctly rounded fp32 division. Divide by a tensor, not a Python scalar: CUDA
    torch turns ``t / 448.0`` into ``t * (1 / 448)``, which is not always the correctly rounded quotient,
    and the scale exponent depends on it.
    """
    return ceil_pow2_byte(amax / torch.full_like(amax, qmax))


def ceil_pow2_byte(s: torch.Tensor) -> torch.Tensor:
    """uint8 biased fp32 exponent of ``2^ceil(log2 s)`` for positive, finite, normal fp32 ``s``.

    The bit trick: the biased exponent of ``s``, plus one when any mantissa bit is set (``s`` is then strictly
    between two powers of two), which adding 0x7FFFFF to the bits does in one carry. This is exact, unlike a
    floating ``log2``. Any other bit pattern gives that rule's int32 result cast to uint8 (a NaN's 256 wraps to
    0), as tests/kernels/test_quant_fp8.py checks on every exponent byte.
    """
    return (((s.to(torch.float32).view(torch.int32) + 0x7FFFFF) >> 23) & 0xFF).to(torch.uint8)


def e8m0_to_float(scale_bytes: torch.Tensor) -> torch.Tensor:
    """fp32 value ``2^(b - 127)`` of each e8m0 byte (0 gives 2^-127, 0xFF gives NaN)."""
    return scale_bytes.view(torch.float8_e8m0fnu).to(torch.float32)


def e4m3_bytes(q: torch.Tensor) -> torch.Tensor:
    """Raw e4m3fn bytes of fp32 ``q`` (torch's cast: round-to-nearest-even).

    Callers clamp to +-448 first: out of range, torch 2.13 on CPU saturates to 448 but torch 2.11 gives
    NaN (0x7F) from about 464 up, on CPU and CUDA alike.
    """
    return q.to(torch.float8_e4m3fn).view(torch.uint8)


_E4M3_TABLES: dict[torch.device, torch.Tensor] = {}


def e4m3_to_float(codes: torch.Tensor) -> torch.Tensor:
    """fp32 value of each raw e4m3fn byte (uint8 or float8_e4m3fn ``codes``, any shape).

    A lookup in a 256-entry table built once per device by torch's own e4m3 -> fp32 cast, so the bits are the
    cast's (NaN codes included; tests/kernels/test_quant_fp8.py checks every byte): on the CPU the cast runs
    element by element and took ~6x the lookup on the window keys the CPU engine decodes in every layer.
    """
    if codes.numel() < 1024:  # a handful of codes: the cast's one op beats the lookup's three
        return codes.view(torch.float8_e4m3fn).to(torch.float32)
    table = _E4M3_TABLES.get(codes.device)
    if table is None:
        table = torch.arange(256, dtype=torch.uint8, device=codes.device).view(torch.float8_e4m3fn).float()
        _E4M3_TABLES[codes.device] = table
    return table.index_select(0, codes.view(torch.uint8).reshape(-1).to(torch.int32)).view(codes.shape)


@triton.jit
def _ceil_pow2_exponent(s):
    """int32 biased exponent of 2^ceil(log2 s) for positive normal fp32 ``s`` (the rule of ``ceil_pow2_byte``)."""
    bits = s.to(tl.int32, bitcast=True)
    exponent = (bits >> 23) & 0xFF
    return exponent + ((bits & 0x7FFFFF) != 0).to(tl.int32)


@triton.jit
def _e8m0_scale_exponent(amax, QMAX: tl.constexpr):
    """int32 e8m0 byte of 2^ceil(log2(amax / QMAX)) for positive normal fp32 ``amax`` (as :func:`e8m0_scale_bytes`).

    div_rn: the scale exponent depends on the correctly rounded quotient; GPU fp32 `/` may be approximate.
    """
    return _ceil_pow2_exponent(tl.math.div_rn(amax, tl.full(amax.shape, QMAX, tl.float32)))


@triton.jit
def _e8m0_to_f32(b):
    """fp32 2^(b - 127) for int32 e8m0 bytes ``b`` (0 -> 2^-127, a subnormal; 255 -> NaN), built from bits."""
    bits = tl.where(b == 0, 0x00400000, b << 23)
    bits = tl.where(b == 255, 0x7FC00000, bits)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _e8m0_reciprocal(b):
    """Exact fp32 2^(127 - b) = 1 / 2^(b - 127) for int32 bytes ``b`` in [1, 253].

    Multiplying by this exact power of two rounds the same as dividing by 2^(b - 127) (both are a single
    rounding of the same real number), so no division is needed on the quantisation paths with e8m0 scales.
    """
    return ((254 - b) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _e8m0_scale(amax, QMAX: tl.constexpr):
    """``(b, inv)``: the int32 e8m0 byte ``b`` of s = 2^ceil(log2(amax / QMAX)) (:func:`_e8m0_scale_exponent`)
    and the exact fp32 1 / s (:func:`_e8m0_reciprocal`), by which the quantisers multiply instead of dividing."""
    b = _e8m0_scale_exponent(amax, QMAX)
    return b, _e8m0_reciprocal(b)


@triton.jit
def _e4m3_code(v):
    """Raw e4m3fn byte (int32) of fp32 ``v`` with |v| <= 448, round-to-nearest-even, sign kept (-0.0 -> 0x80).

    Write |v| = m * 2^(e - 150) (m the 24-bit significand, e the biased exponent, fp32 subnormals at e = 1).
    The e4m3 grid near |v| has step 2^(e4 - 3) with e4 = max(e - 127, -6) (-6: the subnormal range has the
    step of the smallest binade). n = RNE(|v| / step) is then an integer in [0, 16], and the code is
    (e4 + 6) * 8 + n: for subnormals (e4 = -6) that is n itself, and n = 16 carries into the next binade.
    """
    bits = v.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    e = (bits >> 23) & 0xFF
    m = tl.where(e > 0, (bits & 0x7FFFFF) | 0x800000, bits & 0x7FFFFF)
    e = tl.maximum(e, 1)
    e4 = tl.maximum(e - 127, -6)
    # shift >= 20 always; at 26 and above m < 2^24 < half, so every larger shift also rounds to 0.
    shift = tl.minimum(e4 - e + 147, 26)
    n = m >> shift
    rem = m - (n << shift)
    half = 1 << (shift - 1)
    n += ((rem > half) | ((rem == half) & ((n & 1) == 1))).to(tl.int32)
    return sign | tl.minimum((e4 + 6) * 8 + n, 0x7E)


@triton.jit
def _e4m3_to_f32(code):
    """fp32 value of int32 e4m3fn bytes ``code`` (0x80 -> -0.0, 0x7F/0xFF -> NaN), built from bits.

    Normal codes: ((exp + 120) << 23) | (man << 20) is 2^(exp - 7) * (1 + man / 8); subnormals are man * 2^-9.
    """
    mag = code & 0x7F
    exp = mag >> 3
    man = mag & 7
    normal = tl.where(mag == 0x7F, 0x7FC00000, ((exp + 120) << 23) | (man << 20))
    value = tl.where(exp == 0, man.to(tl.float32) * 0.001953125, normal.to(tl.float32, bitcast=True))
    # The sign goes in as a bit: Triton before 3.8 compiles `-v` as `0 - v`, which turns -0.0 into +0.0.
    return (value.to(tl.int32, bitcast=True) | ((code & 0x80) << 24)).to(tl.float32, bitcast=True)


@triton.jit
def _f32_to_bf16_rne(v):
    """bfloat16 of fp32 ``v``, round-to-nearest-even done on the bits.

    Triton's CPU interpreter truncates fp32 -> bf16, so the kernels round by hand to match torch (NaN
    becomes a quiet NaN with the sign kept).
    """
    bits = v.to(tl.int32, bitcast=True)
    mag = bits & 0x7FFFFFFF
    mag = tl.where(mag > 0x7F800000, 0x7FC00000, mag)
    rounded = (mag + 0x7FFF + ((mag >> 16) & 1)) >> 16
    out = ((bits >> 16) & 0x8000) | rounded
    return out.to(tl.uint16).to(tl.bfloat16, bitcast=True)
