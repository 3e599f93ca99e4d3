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
"""

from __future__ import annotations

import torch

from flashtier.kernels.quant.e2m1 import e2m1_codes, e2m1_to_float, pack_nibbles, unpack_nibbles
from flashtier.kernels.quant.e2m1_kernel import triton_dequantize_e2m1, triton_e2m1_qdq, triton_quantize_e2m1
from flashtier.kernels.quant.fp8_bits import e8m0_scale_bytes, e8m0_to_float
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

MXFP4_BLOCK = 32
MXFP4_AMAX_FLOOR = 6 * 2**-126  # s >= 2^-126


def MXFP4_RECORD_BYTES(D: int) -> int:  # noqa: N802 (named like the constant it stands for)
    """Bytes of one packed MXFP4 record for ``D`` elements: D // 2 code bytes + D // 32 scale bytes."""
    if D <= 0 or D % MXFP4_BLOCK != 0:
        raise ValueError(f"MXFP4_RECORD_BYTES: D must be a positive multiple of {MXFP4_BLOCK}, got {D}")
    return D // 2 + D // MXFP4_BLOCK


def quantize_mxfp4(x: torch.Tensor, impl: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise ``x [..., D]`` (fp32/bf16/fp16, D % 32 == 0) to packed e2m1 with e8m0 scales per 32.

    Returns ``(packed uint8[..., D // 2], scales uint8[..., D // 32])``; a scale byte b means 2^(b - 127).
    ``impl``: "auto" (triton on CUDA, else reference), "reference" or "triton"; both give identical bytes.

    Example::

        packed, scales = quantize_mxfp4(torch.tensor([[0.0, 0.5, 1, 1.5, 2, 3, 4, 6] * 4]))
        # scales[0, 0] == 127 (s = 1); packed[0, :4] == [0x10, 0x32, 0x54, 0x76]
    """
    check_float_input(x, "x", "quantize_mxfp4", MXFP4_BLOCK)
    impl = resolve_impl(impl, x, "quantize_mxfp4")
    d = x.shape[-1]
    fn = _reference_quantize_mxfp4 if impl == "reference" else _triton_quantize_mxfp4
    packed, scales = fn(as_rows(x))
    return packed.reshape(*x.shape[:-1], d // 2), scales.reshape(*x.shape[:-1], d // MXFP4_BLOCK)


def dequantize_mxfp4(
    packed: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32, impl: str = "auto"
) -> torch.Tensor:
    """Decode ``packed uint8[..., D // 2]`` with ``scales uint8[..., D // 32]`` to ``dtype [..., D]``.

    Each value is e2m1(code) * 2^(scale - 127), exact in fp32 and bf16; the cast to fp16 rounds to nearest
    even (and overflows to inf outside its range).
    """
    half = check_last_dim(packed, "packed", "dequantize_mxfp4", MXFP4_BLOCK // 2)
    check_byte_tensor(packed, "packed", "dequantize_mxfp4", half, packed.shape[:-1])
    check_byte_tensor(scales, "scales", "dequantize_mxfp4", half * 2 // MXFP4_BLOCK, packed.shape[:-1])
    check_same_device(packed, scales, "packed and scales", "dequantize_mxfp4")
    check_out_dtype(dtype, "dequantize_mxfp4")
    impl = resolve_impl(impl, packed, "dequantize_mxfp4")
    fn = _reference_dequantize_mxfp4 if impl == "reference" else _triton_dequantize_mxfp4
    return fn(as_rows(packed), as_rows(scales), dtype).reshape(*packed.shape[:-1], half * 2)


def mxfp4_qdq(x: torch.Tensor, impl: str = "auto") -> torch.Tensor:
    """``dequantize_mxfp4(*quantize_mxfp4(x))`` in fp32: the model's in-line fake quantisation (fused on GPU)."""
    check_float_input(x, "x", "mxfp4_qdq", MXFP4_BLOCK)
    impl = resolve_impl(impl, x, "mxfp4_qdq")
    rows = as_rows(x)
    if impl == "reference":
        return _reference_dequantize_mxfp4(*_reference_quantize_mxfp4(rows), torch.float32).reshape(x.shape)
    return _triton_mxfp4_qdq(rows).reshape(x.shape)


def pack_mxfp4_record(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``packed uint8[..., D // 2]`` + ``scales uint8[..., D // 32]`` -> ``uint8[..., D // 2 + D // 32]``."""
    half = check_last_dim(packed, "packed", "pack_mxfp4_record", MXFP4_BLOCK // 2)
    check_byte_tensor(packed, "packed", "pack_mxfp4_record", half, packed.shape[:-1])
    check_byte_tensor(scales, "scales", "pack_mxfp4_record", half * 2 // MXFP4_BLOCK, packed.shape[:-1])
    return torch.cat((packed, scales), dim=-1)


def unpack_mxfp4_record(rec: torch.Tensor, D: int) -> tuple[torch.Tensor, torch.Tensor]:  # noqa: N803
    """Split ``rec uint8[..., D // 2 + D // 32]`` into ``(packed, scales)`` (views of ``rec``)."""
    check_record(rec, D, MXFP4_BLOCK, D // 2, D // MXFP4_BLOCK, "unpack_mxfp4_record")
    return rec[..., : D // 2], rec[..., D // 2 :]


def _reference_quantize_mxfp4(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The spec, in plain torch: ``x [R, D]`` -> ``(packed uint8[R, D // 2], scales uint8[R, D // 32])``.

    Rounding: ``max(amax, 6 * 2^-126) / 6`` is one correctly rounded fp32 division, rounded UP to a power
    of two with the exponent bit trick (no floating log2); ``x / s`` is exact (s is a power of two) except
    in fp32's subnormal range, where it rounds once; e2m1 rounds to nearest, ties to the even code.
    """
    r, d = x.shape
    blocks = x.to(torch.float32).reshape(r, d // MXFP4_BLOCK, MXFP4_BLOCK)
    amax = blocks.abs().amax(dim=-1).clamp_min(MXFP4_AMAX_FLOOR)
    scales = e8m0_scale_bytes(amax, 6.0)
    q = blocks / e8m0_to_float(scales).unsqueeze(-1)
    codes = e2m1_codes(q, torch.signbit(blocks)).reshape(r, d)  # -0.0 -> code 8, as the official kernel
    return pack_nibbles(codes), scales


def _reference_dequantize_mxfp4(packed: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The spec of decoding: ``e2m1(code) * 2^(scale - 127)`` in fp32, then cast to ``dtype``."""
    r, half = packed.shape
    values = e2m1_to_float(unpack_nibbles(packed)).reshape(r, scales.shape[-1], MXFP4_BLOCK) * e8m0_to_float(scales).unsqueeze(-1)
    return values.reshape(r, half * 2).to(dtype)


def _triton_quantize_mxfp4(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return triton_quantize_e2m1(x, MXFP4_BLOCK, e8m0=True)


def _triton_mxfp4_qdq(x: torch.Tensor) -> torch.Tensor:
    return triton_e2m1_qdq(x, MXFP4_BLOCK, e8m0=True)


def _triton_dequantize_mxfp4(packed: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return triton_dequantize_e2m1(packed, scales, dtype, MXFP4_BLOCK, e8m0=True)
