"""MXFP4: e2m1 values with one e8m0 scale per 32 elements (indexer q/k cache, expert weights).

Per block of 32 consecutive elements of the last dimension:

    amax = max|x|
    s    = 2^ceil(log2(max(amax, 6 * 2^-126) / 6))   (exact power of two; scale byte = biased exponent, e8m0)
    q    = e2m1_rne(x / s)                            (ties to the even code, saturating at +-6)

Rounding s UP keeps |x / s| <= 6 up to the rounding of amax / 6, so MXFP4 clips no element by more than
that; the floor 6 * 2^-126 keeps s >= 2^-126 (fp32's smallest normal, scale byte >= 1). e2m1 rounding,
sign and nibble packing are described in ``quant/e2m1.py``.

Byte layout of one vector of D elements (D % 32 == 0): ``packed uint8[D // 2]`` (element 2i in the low
nibble of byte i) then ``scales uint8[D // 32]``; :func:`pack_mxfp4_record` concatenates them
(D = 128 gives 64 + 4 = 68 bytes, the indexer-K entry).

Ops (``impl``: "auto" = Triton on CUDA, else the reference; "reference" or "triton"; both give identical bytes):

    quantize_mxfp4(x [..., D] fp32/bf16/fp16)     -> (packed uint8[..., D // 2], scales uint8[..., D // 32]),
                                                     a scale byte b meaning 2^(b - 127)
    dequantize_mxfp4(packed, scales, dtype=fp32)  -> dtype [..., D]: e2m1(code) * 2^(scale - 127), exact in
                                                     fp32 and bf16; fp16 rounds to nearest even (inf outside
                                                     its range)
    mxfp4_qdq(x)                                  -> dequantize_mxfp4(*quantize_mxfp4(x)) in fp32 (fused on GPU)
    pack_mxfp4_record / unpack_mxfp4_record(rec, D), MXFP4_RECORD_BYTES(D)

Example::

    packed, scales = quantize_mxfp4(torch.tensor([[0.0, 0.5, 1, 1.5, 2, 3, 4, 6] * 4]))
    # scales[0, 0] == 127 (s = 1); packed[0, :4] == [0x10, 0x32, 0x54, 0x76]
"""

from __future__ import annotations

import torch

from flashtier.kernels.quant.e2m1_kernel import e2m1_format
from flashtier.kernels.quant.fp8_bits import e8m0_scale_bytes, e8m0_to_float

MXFP4_BLOCK = 32
MXFP4_AMAX_FLOOR = 6 * 2**-126  # s >= 2^-126


def _mxfp4_scale_bytes(amax: torch.Tensor) -> torch.Tensor:
    """Scale bytes of floored block maxima: the e8m0 byte of ``2^ceil(log2(amax / 6))``.

    Rounding: ``amax / 6`` is one correctly rounded fp32 division, rounded UP to a power of two with the
    exponent bit trick (no floating log2); ``x / s`` is then exact (s is a power of two) except in fp32's
    subnormal range, where it rounds once; e2m1 rounds to nearest, ties to the even code.
    """
    return e8m0_scale_bytes(amax, 6.0)


MXFP4 = e2m1_format(
    "mxfp4", MXFP4_BLOCK, e8m0=True, amax_floor=MXFP4_AMAX_FLOOR, scale_bytes=_mxfp4_scale_bytes, scale_to_float=e8m0_to_float
)


# The public ops: ``RowBlockFormat``'s methods (``quant/common.py``), named ``*_mxfp4*`` in their errors.
quantize_mxfp4, dequantize_mxfp4, mxfp4_qdq, pack_mxfp4_record, unpack_mxfp4_record, MXFP4_RECORD_BYTES = MXFP4.ops()
