"""FP8 block-scaled GEMM, the spec in plain torch (``fp8_gemm/op.py`` validates and dispatches).

    y[m, n] = sum over K-blocks kb of 32:  (qa[m, kb] . qw[n, kb]) * sa[m, kb] * sw[n // bn, kb]

qa / qw are e4m3 values, sa / sw their e8m0 (power-of-two) scales; each 32-long block product is an fp32
dot, scaled, and added to an fp32 accumulator in ascending kb: the official ``fp8_gemm`` (model.md §4).
With float activations (``a_scale is None``, the wo_a form) sa = 1 and qa is the activation itself.

Grouped form (``groups`` = G > 1): K = G * Kw and N = G * Ng; output columns g*Ng:(g+1)*Ng use activation
columns g*Kw:(g+1)*Kw and weight rows g*Ng:(g+1)*Ng only (a block-diagonal weight: attention wo_a).
"""

from __future__ import annotations

import torch

from flashtier.kernels.quant.fp8_bits import e4m3_to_float, e8m0_to_float

FP8_GEMM_BLOCK_K = 32


def fp8_gemm_reference(
    a: torch.Tensor,
    a_scale: torch.Tensor | None,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    block_n: int,
    groups: int,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """``y [M, N]`` in ``out_dtype`` for validated inputs (raw uint8 codes and scales, or float ``a``).

    a: uint8 e4m3 codes [M, K] with a_scale uint8 [M, K / 32], or fp32/bf16 values [M, K] with a_scale
    None; w: uint8 e4m3 codes [N, Kw]; w_scale: uint8 [ceil(N / block_n), Kw / 32]. Reads only.
    """
    m, k = a.shape
    n, kw = w.shape
    ng = n // groups
    kb_n = kw // FP8_GEMM_BLOCK_K
    if a_scale is None:
        av = a.to(torch.float32)
    else:
        av = e4m3_to_float(a) * e8m0_to_float(a_scale).repeat_interleave(FP8_GEMM_BLOCK_K, dim=1)
    # Scaling by a power of two commutes with fp32 rounding, so (qa*sa).(qw*sw) over one block equals
    # (qa.qw)*sa*sw bit for bit (no overflow/underflow at e4m3 x e8m0 magnitudes): decode first, then dot.
    sw = e8m0_to_float(w_scale).repeat_interleave(block_n, dim=0)[:n]
    wv = e4m3_to_float(w) * sw.repeat_interleave(FP8_GEMM_BLOCK_K, dim=1)
    av = av.view(m, groups, kb_n, FP8_GEMM_BLOCK_K).transpose(0, 1)  # [G, M, KB, 32]
    wv = wv.view(groups, ng, kb_n, FP8_GEMM_BLOCK_K)  # [G, Ng, KB, 32]
    acc = torch.zeros((groups, m, ng), dtype=torch.float32, device=a.device)
    for kb in range(kb_n):
        acc += torch.bmm(av[:, :, kb], wv[:, :, kb].transpose(1, 2))
    return acc.transpose(0, 1).reshape(m, n).to(out_dtype)
