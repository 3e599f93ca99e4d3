"""Main-KV FP4: e2m1 values with one e4m3fn scale per 16 elements (NVFP4 without a global scale).

Per block of 16 consecutive elements of the last dimension:

    amax = max|x|
    s    = e4m3fn(min(max(amax, 6 * 2^-9) / 6, 448))   (RNE to e4m3, NOT a power of two; scale byte = raw e4m3)
    q    = e2m1_rne(x / float(s))                        (ties to the even code, saturating at +-6)

The floor 6 * 2^-9 keeps s >= 2^-9, the smallest e4m3 subnormal, so s is never 0. The clamp at 448 (a choice
made here; torch's e4m3 cast also saturates) caps s for amax > 2688 = 448 * 6, the format's largest magnitude:
such blocks saturate at +-6 * 448. e2m1 rounding, sign and nibble packing are described in ``quant/e2m1.py``.

Byte layout of one vector of D elements (D % 16 == 0): ``packed uint8[D // 2]`` (element 2i in the low
nibble of byte i, 2i + 1 in the high nibble) then ``scales uint8[D // 16]`` (raw e4m3 bytes);
:func:`pack_fp4_record` concatenates them (D = 512 gives 256 + 32 = 288 bytes, the main-KV entry).

Ops (``impl``: "auto" = Triton on CUDA, else the reference; "reference" or "triton"; both give identical bytes):

    quantize_fp4(x [..., D] fp32/bf16/fp16)       -> (packed uint8[..., D // 2], scales uint8[..., D // 16])
    dequantize_fp4(packed, scales, dtype=fp32)    -> dtype [..., D]: e2m1(code) * e4m3(scale), at most 6
                                                     significant bits, so exact in fp32, bf16 and fp16
    fp4_qdq(x)                                    -> dequantize_fp4(*quantize_fp4(x)) in fp32 (fused on GPU)
    pack_fp4_record / unpack_fp4_record(rec, D), FP4_RECORD_BYTES(D)

Example::

    packed, scales = quantize_fp4(torch.tensor([[0.0, 0.5, 1, 1.5, 2, 3, 4, 6] * 2]))
    # scales[0, 0] == 0x38 (e4m3 1.0); packed[0, :4] == [0x10, 0x32, 0x54, 0x76]
"""

from __future__ import annotations

import torch

from flashtier.kernels.quant.e2m1_kernel import e2m1_format
from flashtier.kernels.quant.fp8_bits import E4M3_MAX, e4m3_bytes, e4m3_to_float

FP4_BLOCK = 16
FP4_AMAX_FLOOR = 6 * 2**-9  # amax floor: s = e4m3(amax / 6) >= 2^-9


def _fp4_scale_bytes(amax: torch.Tensor) -> torch.Tensor:
    """Scale bytes of floored block maxima: ``e4m3(min(amax / 6, 448))``.

    Rounding: ``amax / 6`` is one correctly rounded fp32 division, cast to e4m3 with RNE (so s may round
    below amax / 6 and a block's largest element may saturate at 6); ``x / s`` is then one correctly rounded
    fp32 division; e2m1 rounds to nearest, ties to the even code.
    """
    # Divide by tensors, not Python scalars: CUDA torch turns `t / 6.0` into `t * (1 / 6)`.
    return e4m3_bytes((amax / torch.full_like(amax, 6.0)).clamp_max(E4M3_MAX))


FP4 = e2m1_format(
    "fp4", FP4_BLOCK, e8m0=False, amax_floor=FP4_AMAX_FLOOR, scale_bytes=_fp4_scale_bytes, scale_to_float=e4m3_to_float
)


# The public ops: ``RowBlockFormat``'s methods (``quant/common.py``), named ``*_fp4*`` in their errors.
quantize_fp4, dequantize_fp4, fp4_qdq, pack_fp4_record, unpack_fp4_record, FP4_RECORD_BYTES = FP4.ops()
