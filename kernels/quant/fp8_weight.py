"""FP8 weights in the checkpoint format: e4m3fn values with one ue8m0 scale per 2-D block.

A weight ``w [N, K]`` is cut into blocks of ``block = (bn, bk)`` (V4.1: 32 x 32; the Engram table uses
1 x 32 row blocks, ``[R, 256]`` e4m3 + ``[R, 8]`` scales). The last block row and column may be ragged.
Per block, the window-KV FP8 rule (``quant/fp8.py``):

    amax = max(max|w|, 1e-4);  s = 2^ceil(log2(amax / 448));  q = e4m3fn(clamp(w / s, -448, 448))

Layout: ``q torch.float8_e4m3fn [N, K]`` (row-major) and ``scale torch.float8_e8m0fnu [ceil(N/bn), ceil(K/bk)]``,
``scale[i, j]`` covering rows ``i*bn : (i+1)*bn`` and columns ``j*bk : (j+1)*bk``. Both are one byte per
element; :func:`as_raw_bytes`, :func:`as_e4m3fn` and :func:`as_e8m0` convert between views.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashtier.kernels.quant.common import FLOAT_DTYPES, check_out_dtype, check_same_device, resolve_impl
from flashtier.kernels.quant.fp8 import _fp8_codes, _fp8_scale, _fp8_values, reference_fp8_blocks
from flashtier.kernels.quant.fp8_bits import e4m3_to_float, e8m0_to_float

_MAX_BLOCK_ELEMS = 128 * 128  # one block is one Triton tile
_TILE_ELEMS = 1024  # small blocks (e.g. 1 x 32) are grouped so that a program covers about this many elements


def as_raw_bytes(t: torch.Tensor) -> torch.Tensor:
    """A uint8 view of a one-byte tensor (float8_e4m3fn, float8_e8m0fnu or uint8)."""
    if t.element_size() != 1:
        raise ValueError(f"as_raw_bytes: expected a one-byte dtype, got {t.dtype} (shape {tuple(t.shape)})")
    return t.view(torch.uint8)


def as_e4m3fn(raw: torch.Tensor) -> torch.Tensor:
    """A torch.float8_e4m3fn view of raw e4m3 bytes (uint8)."""
    return as_raw_bytes(raw).view(torch.float8_e4m3fn)


def as_e8m0(raw: torch.Tensor) -> torch.Tensor:
    """A torch.float8_e8m0fnu view of raw e8m0 scale bytes (uint8)."""
    return as_raw_bytes(raw).view(torch.float8_e8m0fnu)


def quantize_fp8_weight(
    w: torch.Tensor, block: tuple[int, int] = (32, 32), impl: str = "auto"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise ``w [N, K]`` (fp32/bf16/fp16) to ``q float8_e4m3fn [N, K]`` and ``scale float8_e8m0fnu``
    ``[ceil(N/bn), ceil(K/bk)]``.

    ``block = (bn, bk)``: powers of two with bn * bk <= 16384. ``impl``: "auto" (triton on CUDA, else
    reference), "reference" or "triton"; both give identical bytes.

    Example::

        q, scale = quantize_fp8_weight(torch.randn(100, 96))       # scale: [4, 3]
        q, scale = quantize_fp8_weight(table, block=(1, 32))       # Engram rows [R, 256] -> scale [R, 8]
    """
    op = "quantize_fp8_weight"
    if not isinstance(w, torch.Tensor) or w.dim() != 2 or w.dtype not in FLOAT_DTYPES:
        got = f"{w.dtype} {tuple(w.shape)}" if isinstance(w, torch.Tensor) else type(w).__name__
        raise ValueError(f"{op}: w must be a 2-D float32/bfloat16/float16 tensor [N, K], got {got}")
    bn, bk = _check_block(block, op)
    impl = resolve_impl(impl, w, op)
    fn = _reference_quantize_fp8_weight if impl == "reference" else _triton_quantize_fp8_weight
    codes, scales = fn(w, bn, bk)
    return as_e4m3fn(codes), as_e8m0(scales)


def dequantize_fp8_weight(
    q: torch.Tensor,
    scale: torch.Tensor,
    block: tuple[int, int] = (32, 32),
    dtype: torch.dtype = torch.float32,
    impl: str = "auto",
) -> torch.Tensor:
    """Decode ``q [N, K]`` (float8_e4m3fn or raw uint8) with ``scale [ceil(N/bn), ceil(K/bk)]`` (float8_e8m0fnu
    or raw uint8) to ``dtype [N, K]``: e4m3(q) * 2^(scale - 127), exact in fp32, cast to bf16/fp16 with RNE.
    """
    op = "dequantize_fp8_weight"
    if not isinstance(q, torch.Tensor) or q.dim() != 2 or q.dtype not in (torch.float8_e4m3fn, torch.uint8):
        got = f"{q.dtype} {tuple(q.shape)}" if isinstance(q, torch.Tensor) else type(q).__name__
        raise ValueError(f"{op}: q must be a 2-D float8_e4m3fn (or uint8) tensor [N, K], got {got}")
    if not isinstance(scale, torch.Tensor) or scale.dtype not in (torch.float8_e8m0fnu, torch.uint8):
        got = scale.dtype if isinstance(scale, torch.Tensor) else type(scale).__name__
        raise ValueError(f"{op}: scale must be a float8_e8m0fnu (or uint8) tensor, got {got}")
    bn, bk = _check_block(block, op)
    n, k = q.shape
    expected = (triton.cdiv(n, bn), triton.cdiv(k, bk))
    if tuple(scale.shape) != expected:
        raise ValueError(
            f"{op}: scale must have shape {expected} for q {tuple(q.shape)} and block {(bn, bk)}, "
            f"got {tuple(scale.shape)}"
        )
    check_same_device(q, scale, "q and scale", op)
    check_out_dtype(dtype, op)
    impl = resolve_impl(impl, q, op)
    fn = _reference_dequantize_fp8_weight if impl == "reference" else _triton_dequantize_fp8_weight
    return fn(as_raw_bytes(q), as_raw_bytes(scale), bn, bk, dtype)


def _check_block(block: tuple[int, int], op: str) -> tuple[int, int]:
    ok = isinstance(block, (tuple, list)) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)
    if not ok or any(b & (b - 1) for b in block) or block[0] * block[1] > _MAX_BLOCK_ELEMS:
        raise ValueError(
            f"{op}: block must be (bn, bk), powers of two with bn * bk <= {_MAX_BLOCK_ELEMS}, got {block!r}"
        )
    return int(block[0]), int(block[1])


def _reference_quantize_fp8_weight(w: torch.Tensor, bn: int, bk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The spec, in plain torch: ``w [N, K]`` -> ``(codes uint8[N, K], scales uint8[ceil(N/bn), ceil(K/bk)])``.

    Ragged edge blocks are zero-padded, which leaves amax unchanged; each block then follows the window-KV
    FP8 rule (``reference_fp8_blocks`` of ``quant/fp8.py``).
    """
    n, k = w.shape
    nb, kb = triton.cdiv(n, bn), triton.cdiv(k, bk)
    padded = torch.zeros((nb * bn, kb * bk), dtype=torch.float32, device=w.device)
    padded[:n, :k] = w
    codes, scales = reference_fp8_blocks(padded.reshape(nb, bn, kb, bk), (1, 3))
    return codes.reshape(nb * bn, kb * bk)[:n, :k].contiguous(), scales


def _reference_dequantize_fp8_weight(
    codes: torch.Tensor, scales: torch.Tensor, bn: int, bk: int, dtype: torch.dtype
) -> torch.Tensor:
    """The spec of decoding: each element times its block's 2^(scale - 127), in fp32, then cast."""
    n, k = codes.shape
    s = e8m0_to_float(scales).repeat_interleave(bn, dim=0).repeat_interleave(bk, dim=1)[:n, :k]
    return (e4m3_to_float(codes) * s).to(dtype)


@triton.jit
def _fp8_weight_tile(i_pid, n, k, n_nb, n_kb, BN: tl.constexpr, BK: tl.constexpr, G: tl.constexpr):
    # Program i_pid covers G vertically adjacent blocks of one block column:
    # block rows i_nb .. i_nb + G - 1, block column i_kb; element (g, r, c) is w[(i_nb + g) * BN + r, i_kb * BK + c].
    i_kb = i_pid % n_kb
    o_b = (i_pid // n_kb) * G + tl.arange(0, G)
    o_r = o_b[:, None, None] * BN + tl.arange(0, BN)[None, :, None]
    o_c = i_kb * BK + tl.arange(0, BK)[None, None, :]
    m = (o_r < n) & (o_c < k)
    return i_kb, o_b, o_r, o_c, m, o_b < n_nb


@triton.jit
def _quantize_fp8_weight_kernel(
    p_w, p_q, p_s, n, k, stride_wn, stride_wk, n_nb, n_kb, BN: tl.constexpr, BK: tl.constexpr, G: tl.constexpr
):
    # Traffic per block: read BN * BK weights, write BN * BK + 1 bytes.
    i_kb, o_b, o_r, o_c, m, m_b = _fp8_weight_tile(tl.program_id(0).to(tl.int64), n, k, n_nb, n_kb, BN, BK, G)
    b_w = tl.load(p_w + o_r * stride_wn + o_c * stride_wk, mask=m, other=0.0).to(tl.float32)
    b_exp, b_inv = _fp8_scale(tl.max(tl.max(tl.abs(b_w), axis=2), axis=1))
    b_code = _fp8_codes(b_w, b_inv[:, None, None])
    tl.store(p_q + o_r * k + o_c, b_code.to(tl.uint8), mask=m)
    tl.store(p_s + o_b * n_kb + i_kb, b_exp.to(tl.uint8), mask=m_b)


# The row counts follow the batch where an Engram gather decodes its rows (T tokens x H heads, block 1 x 32):
# left unspecialised, and the blocks per program fixed by the block shape alone, so no batch compiles a variant
# the warm-up did not (see engine/warmup.py).
DEQUANT_COUNTS = ("n", "n_nb")


@triton.jit(do_not_specialize=DEQUANT_COUNTS)
def _dequantize_fp8_weight_kernel(
    p_q, p_s, p_out, n, k, n_nb, n_kb, BN: tl.constexpr, BK: tl.constexpr, G: tl.constexpr, OUT_BF16: tl.constexpr
):
    i_kb, o_b, o_r, o_c, m, m_b = _fp8_weight_tile(tl.program_id(0).to(tl.int64), n, k, n_nb, n_kb, BN, BK, G)
    b_code = tl.load(p_q + o_r * k + o_c, mask=m, other=0).to(tl.int32)
    b_exp = tl.load(p_s + o_b * n_kb + i_kb, mask=m_b, other=127).to(tl.int32)
    tl.store(p_out + o_r * k + o_c, _fp8_values(b_code, b_exp[:, None, None], OUT_BF16), mask=m)


def _tile_groups(bn: int, bk: int) -> int:
    """Blocks per program: enough small blocks for about _TILE_ELEMS elements. A constexpr of the block shape
    only (not clamped to the block rows there are): a clamp would compile one variant per power of two of a
    batch-sized gather; a program past the last block row is masked."""
    return max(1, _TILE_ELEMS // (bn * bk))


def _triton_quantize_fp8_weight(w: torch.Tensor, bn: int, bk: int) -> tuple[torch.Tensor, torch.Tensor]:
    n, k = w.shape
    n_nb, n_kb = triton.cdiv(n, bn), triton.cdiv(k, bk)
    codes = torch.empty((n, k), dtype=torch.uint8, device=w.device)
    scales = torch.empty((n_nb, n_kb), dtype=torch.uint8, device=w.device)
    if n and k:
        g = _tile_groups(bn, bk)
        grid = (triton.cdiv(n_nb, g) * n_kb,)
        _quantize_fp8_weight_kernel[grid](
            w, codes, scales, n, k, w.stride(0), w.stride(1), n_nb, n_kb, BN=bn, BK=bk, G=g
        )
    return codes, scales


def _triton_dequantize_fp8_weight(
    codes: torch.Tensor, scales: torch.Tensor, bn: int, bk: int, dtype: torch.dtype
) -> torch.Tensor:
    codes, scales = codes.contiguous(), scales.contiguous()
    n, k = codes.shape
    n_nb, n_kb = scales.shape
    out = torch.empty((n, k), dtype=dtype, device=codes.device)
    if n and k:
        g = _tile_groups(bn, bk)
        grid = (triton.cdiv(n_nb, g) * n_kb,)
        _dequantize_fp8_weight_kernel[grid](
            codes, scales, out, n, k, n_nb, n_kb, BN=bn, BK=bk, G=g, OUT_BF16=dtype == torch.bfloat16
        )
    return out
