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
"""

from __future__ import annotations

import torch

from flashtier.kernels.quant.e2m1 import e2m1_codes, e2m1_to_float, pack_nibbles, unpack_nibbles
from flashtier.kernels.quant.e2m1_kernel import triton_dequantize_e2m1, triton_e2m1_qdq, triton_quantize_e2m1
from flashtier.kernels.quant.fp8_bits import E4M3_MAX, e4m3_bytes, e4m3_to_float
from flashtier.kernels.quant.common import (
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
    codes = e2m1_codes(q, torch.signbit(blocks)).reshape(r, d)  # -0.0 -> code 8, as the official kernel
    return pack_nibbles(codes), scales


def _reference_dequantize_fp4(packed: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The spec of decoding: ``e2m1(code) * e4m3(scale)`` in fp32, then cast to ``dtype``."""
    r, half = packed.shape
    values = e2m1_to_float(unpack_nibbles(packed)).reshape(r, scales.shape[-1], FP4_BLOCK) * e4m3_to_float(scales).unsqueeze(-1)
    return values.reshape(r, half * 2).to(dtype)


def _triton_quantize_fp4(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return triton_quantize_e2m1(x, FP4_BLOCK, e8m0=False)


def _triton_fp4_qdq(x: torch.Tensor) -> torch.Tensor:
    return triton_e2m1_qdq(x, FP4_BLOCK, e8m0=False)


def _triton_dequantize_fp4(packed: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return triton_dequantize_e2m1(packed, scales, dtype, FP4_BLOCK, e8m0=False)
