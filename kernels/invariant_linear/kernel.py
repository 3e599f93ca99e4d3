"""Batch-invariant linear in Triton: ``y [M, N] = x [M, K] @ w [N, K]^T`` with one fixed reduction order per row.

A program owns BLOCK_N weight rows and BLOCK_M activation rows. K is cut into SPLITS fixed ranges (a function of
N and K only, never of M); each range is walked in BLOCK_K steps from its start into a partial that starts at
zero, and the partials are added in ascending split order (no atomics). So an output element is the same sum
of the same partial MMAs whichever rows share its launch. Two launch forms give the same bits:

- M <= 64 (decode): grid ``(cdiv(N, BLOCK_N), cdiv(M, BLOCK_M), SPLITS)``, fp32 partials [S, M, N] and the
  ordered reduce of ``_fp8_gemm_triton`` (small N and long K get enough programs to keep HBM busy);
- M > 64: grid ``(cdiv(N, BLOCK_N), cdiv(M, BLOCK_M))``, each program runs its splits one after the other and
  adds them in the same order (no workspace; there are enough programs already).

BLOCK_K and the MMA kind depend on the dtypes only; BLOCK_M on the row count (the MMA's N: tile width only).
The MMA is "swapped" (weight rows are the MMA's M, activation rows its N) so 1-64 rows fill a 64-row MMA.

Modes (constexpr ``MODE``):
  0  x bf16, w bf16: bf16 MMAs, fp32 accumulation, bf16 output (``F.linear`` in bf16).
  1  x fp32, w bf16: x split exactly into three bf16 parts (hi + mid + lo = x: 8 + 8 + 8 significant bits),
     three bf16 MMAs against the exact weight: exact products summed in fp32 (fp32 output).
  2  x fp32, w fp32 (the mHC mixes, [24, 4 x 5120]): both split exactly into three bf16 parts, and the six
     part products above 2^-24 of the leading one (hi.hi, hi.mid, mid.hi, hi.lo, lo.hi, mid.mid) summed
     smallest first on the tensor cores (exact products, fp32 accumulation; the three dropped ones are below
     2^-32 of |w||x|), fp32 output.
Under TRITON_INTERPRET=1 every mode runs one fp32 dot on the upcast values (numpy cannot take bf16).

Why mode 2 is not an fp32 FMA dot (``input_precision="ieee"``, the form before): Triton runs that dot on the
CUDA cores, and its work grows with the row tile while the weight bytes do not. The float linears took 1.8 ms per
step at one row and 7.0 ms at 64 (docs/perf/gpu_step.json); the head and compressor already ran on the tensor
cores, so the likely cause (an estimate from the FMA count, not a per-call profile) is the mHC mixes: two calls
per layer, K = 20480, a 64 x 64 FMA tile for 24 outputs, ~1.3 M FMAs per program at 64 rows. Six bf16 MMAs of
the same tile are tensor-core work of a few microseconds. BLOCK_K is one constant for every mode (64): with
several MMAs per step the step length is part of the summation order, so it must not follow the batch either.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from flashtier.kernels.fp8_gemm.kernel import _REDUCE_BLOCK, _split_reduce_kernel, _store_tile

MODE_BF16, MODE_F32_X_BF16_W, MODE_F32 = 0, 1, 2
_INLINE_ABOVE = 64  # rows: above, the splits run inside each program


@dataclass(frozen=True)
class LinearConfig:
    """Launch shape: ``block_m`` >= 16 activation rows, ``block_n`` weight rows, ``block_k`` K per step,
    ``split_k`` K ranges (part of the reduction order: keep it a function of N and K)."""

    block_m: int
    block_k: int
    split_k: int
    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 3


@functools.lru_cache(maxsize=8)
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132


def default_config(m: int, n: int, k: int, mode: int, device: torch.device) -> LinearConfig:
    """Splits from (N, K) until ~2 programs per SM with >= 8 K steps each; BLOCK_K 64 for every mode."""
    block_k = 64
    tiles, split = triton.cdiv(n, 64), 1
    while tiles * split < 2 * _sm_count(device) and k // (2 * split) >= 8 * block_k:
        split *= 2
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    return LinearConfig(block_m=block_m, block_k=block_k, split_k=split)


@triton.jit
def _partial(p_x, p_w, o_m, m_m, o_n, m_n, k_lo, k_hi, stride_xm, stride_wn,
             MODE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
             INTERPRET: tl.constexpr):
    """sum over [k_lo, k_hi) of W[o_n] . X[o_m] in BLOCK_K steps from zero -> [BLOCK_N, BLOCK_M] fp32."""
    o_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        k = k0 + o_k
        m_k = k < k_hi
        b_w = tl.load(p_w + o_n[:, None] * stride_wn + k[None, :], mask=m_n[:, None] & m_k[None, :], other=0.0)
        b_x = tl.load(p_x + o_m[:, None] * stride_xm + k[None, :], mask=m_m[:, None] & m_k[None, :], other=0.0)
        if INTERPRET:
            acc += tl.dot(b_w.to(tl.float32), tl.trans(b_x.to(tl.float32)))
        elif MODE == 0:
            acc = tl.dot(b_w, tl.trans(b_x), acc)
        elif MODE == 1:
            hi = b_x.to(tl.bfloat16)
            r = b_x - hi.to(tl.float32)
            mid = r.to(tl.bfloat16)
            lo = (r - mid.to(tl.float32)).to(tl.bfloat16)
            # smallest part first: the three exact products lose the least to the fp32 additions
            p = tl.dot(b_w, tl.trans(lo))
            p = tl.dot(b_w, tl.trans(mid), p)
            p = tl.dot(b_w, tl.trans(hi), p)
            acc += p
        else:
            xh, xm, xl = _split3(b_x)
            wh, wm, wl = _split3(b_w)
            # smallest first: the five small products lose the least to the fp32 additions
            p = tl.dot(wm, tl.trans(xm))
            p = tl.dot(wl, tl.trans(xh), p)
            p = tl.dot(wh, tl.trans(xl), p)
            p = tl.dot(wm, tl.trans(xh), p)
            p = tl.dot(wh, tl.trans(xm), p)
            p = tl.dot(wh, tl.trans(xh), p)
            acc += p
    return acc


@triton.jit
def _split3(b):
    """fp32 ``b`` as three bf16 parts with hi + mid + lo == b exactly (8 + 8 + 8 significant bits)."""
    hi = b.to(tl.bfloat16)
    r = b - hi.to(tl.float32)
    mid = r.to(tl.bfloat16)
    lo = (r - mid.to(tl.float32)).to(tl.bfloat16)
    return hi, mid, lo


# Integer arguments that follow the batch, left unspecialised (engine/warmup.py says why)
BATCH_COUNTS = ("M", "stride_ys")  # stride_ys = M * N


@triton.jit(do_not_specialize=BATCH_COUNTS)
def _linear_kernel(
    p_x, p_w, p_y, M, N, K, k_split, stride_xm, stride_wn, stride_ys, stride_ym,
    MODE: tl.constexpr, SPLITS: tl.constexpr, INLINE: tl.constexpr, OUT_BF16: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, INTERPRET: tl.constexpr,
):
    i_n, i_m = tl.program_id(0), tl.program_id(1)
    o_n = (i_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    o_m = (i_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    m_n, m_m = o_n < N, o_m < M
    if INLINE:
        acc = _partial(p_x, p_w, o_m, m_m, o_n, m_n, 0, tl.minimum(k_split, K), stride_xm, stride_wn,
                       MODE, BLOCK_M, BLOCK_N, BLOCK_K, INTERPRET)
        for s in range(1, SPLITS):
            k_lo = s * k_split
            acc += _partial(p_x, p_w, o_m, m_m, o_n, m_n, k_lo, tl.minimum(k_lo + k_split, K), stride_xm, stride_wn,
                            MODE, BLOCK_M, BLOCK_N, BLOCK_K, INTERPRET)
        i_s = 0
    else:
        i_s = tl.program_id(2)
        k_lo = i_s * k_split
        acc = _partial(p_x, p_w, o_m, m_m, o_n, m_n, k_lo, tl.minimum(k_lo + k_split, K), stride_xm, stride_wn,
                       MODE, BLOCK_M, BLOCK_N, BLOCK_K, INTERPRET)
    _store_tile(p_y, acc, i_s, stride_ys, stride_ym, o_m, m_m, o_n, m_n, OUT_BF16)


def linear_triton(x: torch.Tensor, w: torch.Tensor, mode: int, out: torch.Tensor,
                  config: LinearConfig | None = None) -> torch.Tensor:
    """Launch on validated inputs (x [M, K] and w [N, K] dense in their last axis); writes ``out [M, N]``."""
    m, k = x.shape
    n = w.shape[0]
    cfg = config or default_config(m, n, k, mode, x.device)
    k_split = triton.cdiv(triton.cdiv(k, cfg.block_k), cfg.split_k) * cfg.block_k
    splits = triton.cdiv(k, k_split)
    inline = splits == 1 or m > _INLINE_ABOVE
    out_bf16 = out.dtype == torch.bfloat16
    target = out if inline else torch.empty((splits, m, n), dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(n, cfg.block_n), triton.cdiv(m, cfg.block_m)) + (() if inline else (splits,))
    _linear_kernel[grid](
        x, w, target, m, n, k, k_split, x.stride(0), w.stride(0), m * n, n,
        MODE=mode, SPLITS=splits, INLINE=inline, OUT_BF16=out_bf16 and inline,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        INTERPRET=os.environ.get("TRITON_INTERPRET", "0") == "1", num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    if not inline:
        _split_reduce_kernel[(triton.cdiv(m * n, _REDUCE_BLOCK),)](
            target, out, m * n, S=splits, BLOCK=_REDUCE_BLOCK, OUT_BF16=out_bf16
        )
    return out
