"""FP4 e2m1 codes: rounding, decoding and nibble packing, in torch and in Triton.

Code layout (4 bits): bit 3 = sign, bits 0-2 = magnitude index into E2M1_VALUES = {0, 0.5, 1, 1.5, 2, 3, 4, 6}.
The index is also the e2m1 bit pattern (2 exponent bits, 1 mantissa bit), so an "even code" has mantissa 0.

Rounding (used by both FP4 formats, as the model's TileLang quantiser does): round to nearest, ties to the
even code, saturating at 6. Per magnitude ``a = |x / s|``:

    a <= 0.25 -> 0      0.25 < a < 0.75 -> 0.5    0.75 <= a <= 1.25 -> 1    1.25 < a < 1.75 -> 1.5
    1.75 <= a <= 2.5 -> 2    2.5 < a < 3.5 -> 3    3.5 <= a <= 5 -> 4    a > 5 -> 6

i.e. the ties 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5 go to 0, 1, 1, 2, 2, 4, 4. The code's sign bit is the
input's sign bit, so -0.0 and every negative value that rounds to zero (-0.1, -0.25) give code 8 ("negative
zero", decoded as -0.0), and quantising a decoded -0.0 again gives code 8 once more. Non-finite inputs are
outside the contract.

Why code 8: it is the byte the official quantiser writes, so FP4 records stay byte-identical to it.
``fp4_quant_kernel`` of the official ``inference/kernel.py`` (V4-Flash copy: lines 129-183, the cast at
169-177; V4.1 calls the same ``fp4_act_quant`` from ``Indexer.forward`` and ``Attention._compress_kv``)
stores ``T.Cast(FP4, clamp(x / s, -6, 6))``. TileLang lowers that cast to ``__nv_fp4_e2m1(float)``
(``src/tl_templates/cuda/cuda_fp4.h``, ``fp4_e2_t(float)``), i.e. CUDA's ``__nv_cvt_float_to_fp4(x,
__NV_E2M1, cudaRoundNearest)``; on SM90 that is ``__nv_cvt_double_to_fp4`` in ``cuda_fp4.hpp``, which
returns 0 for |x| <= 0.25 and then ORs in the input's sign bit (``res |= sign``): -0.0 -> 0x8.

Packing: two codes per byte, the EVEN element in the LOW nibble: ``byte[i] = code[2i] | code[2i+1] << 4``.

:func:`reference_quantize_e2m1` and :func:`reference_dequantize_e2m1` are the specs of both formats
(``quant/fp4.py``, ``quant/mxfp4.py``), given the format's block size and scale encoding.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_MAX = 6.0


def e2m1_codes(q: torch.Tensor, negative: torch.Tensor) -> torch.Tensor:
    """uint8 e2m1 codes of fp32 ``q`` (already divided by its scale); ``negative`` sets the sign bit.

    Callers pass ``torch.signbit(x)`` of the unscaled input (True for -0.0 too, see the module docstring).

    Each comparison adds one step up the value table; ">" at a midpoint leaves the tie on the lower
    (even) code, ">=" sends it to the upper (even) code.
    """
    a = q.abs()
    index = (
        (a > 0.25).to(torch.uint8)
        + (a >= 0.75)
        + (a > 1.25)
        + (a >= 1.75)
        + (a > 2.5)
        + (a >= 3.5)
        + (a > 5.0)
    )
    return index | (negative.to(torch.uint8) << 3)


_BYTE_TABLES: dict[torch.device, torch.Tensor] = {}


def _byte_table(device: torch.device) -> torch.Tensor:
    """fp32 [256, 2]: byte b -> (value of its low-nibble code, value of its high-nibble code), one per device."""
    table = _BYTE_TABLES.get(device)
    if table is None:
        codes = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), dtype=torch.float32)  # code 8: -0.0
        table = torch.stack((codes.repeat(16), codes.repeat_interleave(16)), dim=-1).to(device)
        _BYTE_TABLES[device] = table
    return table


def packed_e2m1_to_float(packed: torch.Tensor) -> torch.Tensor:
    """fp32 ``[..., 2 * D]`` values of packed uint8 ``[..., D]`` (even element in the low nibble; code 8 is -0.0),
    one lookup per byte in a 256-entry table (the CPU engine decodes every FP4 entry it reads; the table is ~6x
    faster than splitting the nibbles and decoding each code)."""
    flat = _byte_table(packed.device).index_select(0, packed.reshape(-1).to(torch.int32))
    return flat.reshape(*packed.shape[:-1], 2 * packed.shape[-1])


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """uint8 ``[..., D]`` codes -> ``[..., D // 2]`` bytes, even index in the low nibble."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def reference_quantize_e2m1(
    x: torch.Tensor,
    block: int,
    amax_floor: float,
    scale_bytes: Callable[[torch.Tensor], torch.Tensor],
    scale_to_float: Callable[[torch.Tensor], torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows ``x [R, D]`` -> ``(packed uint8[R, D // 2], scales uint8[R, D // block])``, in plain torch.

    Per block: ``amax = max(max|x|, amax_floor)``, the scale byte ``scale_bytes(amax)`` (the format's rule),
    ``q = x / scale_to_float(byte)`` (one fp32 division), then e2m1 codes rounded as described above.
    """
    r, d = x.shape
    blocks = x.to(torch.float32).reshape(r, d // block, block)
    amax = blocks.abs().amax(dim=-1).clamp_min(amax_floor)
    scales = scale_bytes(amax)
    q = blocks / scale_to_float(scales).unsqueeze(-1)
    codes = e2m1_codes(q, torch.signbit(blocks)).reshape(r, d)  # -0.0 -> code 8, as the official kernel
    return pack_nibbles(codes), scales


def reference_dequantize_e2m1(
    packed: torch.Tensor,
    scales: torch.Tensor,
    dtype: torch.dtype,
    block: int,
    scale_to_float: Callable[[torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """Rows ``packed uint8[R, D // 2]`` with ``scales uint8[R, D // block]`` -> ``dtype [R, D]``: each value
    ``e2m1(code) * scale_to_float(scale)`` in fp32, then cast to ``dtype``."""
    r, half = packed.shape
    values = packed_e2m1_to_float(packed).reshape(r, scales.shape[-1], block) * scale_to_float(scales).unsqueeze(-1)
    return values.reshape(r, half * 2).to(dtype)


@triton.jit
def _sign_bit(x):
    """bool: the sign bit of fp32 ``x`` (True for -0.0, unlike ``x < 0``)."""
    return x.to(tl.int32, bitcast=True) < 0


@triton.jit
def _e2m1_code(q, negative):
    """int32 e2m1 codes of fp32 ``q``; ``negative`` (bool) sets bit 3. Same comparisons as :func:`e2m1_codes`."""
    a = tl.abs(q)
    index = (
        (a > 0.25).to(tl.int32)
        + (a >= 0.75).to(tl.int32)
        + (a > 1.25).to(tl.int32)
        + (a >= 1.75).to(tl.int32)
        + (a > 2.5).to(tl.int32)
        + (a >= 3.5).to(tl.int32)
        + (a > 5.0).to(tl.int32)
    )
    return index | (negative.to(tl.int32) << 3)


@triton.jit
def _e2m1_to_f32(code):
    """fp32 value of int32 e2m1 codes: index i -> i / 2 for i <= 4, then 3, 4, 6."""
    i = code & 7
    magnitude = tl.where(i <= 4, i.to(tl.float32) * 0.5, (i - 2).to(tl.float32))
    magnitude = tl.where(i == 7, 6.0, magnitude)
    # The sign goes in as a bit, so code 8 gives -0.0 (Triton before 3.8 compiles `-v` as `0 - v`).
    return (magnitude.to(tl.int32, bitcast=True) | ((code & 8) << 28)).to(tl.float32, bitcast=True)
