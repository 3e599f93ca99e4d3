"""FP8 activation quantisation of a column slice, equal to quantising the whole row and slicing.

The official ``linear()`` quantises a GEMM input per 32 consecutive elements along K (e4m3, one ue8m0
scale per block: ``amax -> s = 2^ceil(log2(amax / 448))``). A row-parallel GEMM holds only columns
``[start, start + size)`` of that input on each rank. When the slice starts and ends on block
boundaries the blocks are whole and the local quantisation is already exact. Otherwise a block
straddles ranks and its scale needs the amax of all its elements: one MAX all-reduce of the
per-block amax over the group, then each rank quantises its columns with the block's true amax
(written into the columns it does not hold, so the unmodified kernel picks the same scale)::

    rank 0 holds columns 0..15, rank 1 columns 16..31 of one block
    amax_b = max(max|x_0..15|, max|x_16..31|)               (all-reduce MAX)
    rank 0 quantises [x_0 .. x_15, amax_b .. amax_b]         keeps the first 16
    rank 1 quantises [amax_b .. amax_b, x_16 .. x_31]        keeps the last 16

The real geometry (experts 2304 wide over up to 8 ranks, wo_b's 1024-wide groups) never straddles;
narrow test geometries (tiny: 32-wide experts over 2 or 4 ranks) do.
"""

from __future__ import annotations

import torch

from flashtier.engine.parallel.group_comm import GroupComm
from flashtier.engine.parallel.shard import Shard
from flashtier.kernels.quant.fp8 import FP8_BLOCK, fp8_qdq


def column_shard_qdq(x: torch.Tensor, cols: Shard, width: int, comm: GroupComm) -> torch.Tensor:
    """FP8 quantise-dequantise of x [n, cols.size], the columns ``cols`` of rows ``width`` wide.

    fp32 in, fp32 out; float64 x is rounded to fp32 first and returned as float64 (``numerics.qdq``).
    Collective over ``comm`` when the slice is not block-aligned: every rank of the group must call it
    with the same n, a slice of the same size and the same ``width``. Reads x only. ValueError when
    ``width`` is not a multiple of the block or the slice lies outside it.
    """
    if width % FP8_BLOCK or cols.start < 0 or cols.stop > width or x.shape[-1] != cols.size:
        raise ValueError(f"cols {cols} of x {tuple(x.shape)} must lie inside rows of width {width} "
                         f"(a multiple of {FP8_BLOCK})")
    xf = x.float()
    if cols.start % FP8_BLOCK == 0 and cols.size % FP8_BLOCK == 0:
        out = fp8_qdq(xf)
    else:
        out = _straddled(xf, cols, width, comm)
    return out.double() if x.dtype == torch.float64 else out


def _straddled(xf: torch.Tensor, cols: Shard, width: int, comm: GroupComm) -> torch.Tensor:
    n = xf.shape[0]
    lead = cols.start % FP8_BLOCK
    first = cols.start // FP8_BLOCK
    n_local = -(-(lead + cols.size) // FP8_BLOCK)
    padded = xf.new_zeros(n, n_local * FP8_BLOCK)
    padded[:, lead : lead + cols.size] = xf
    amax = xf.new_zeros(n, width // FP8_BLOCK)
    amax[:, first : first + n_local] = padded.abs().view(n, n_local, FP8_BLOCK).amax(-1)
    amax = comm.all_reduce_max(amax)[:, first : first + n_local]
    held = torch.zeros(padded.shape[1], dtype=torch.bool, device=xf.device)
    held[lead : lead + cols.size] = True
    filled = torch.where(held, padded, amax.repeat_interleave(FP8_BLOCK, dim=1))
    return fp8_qdq(filled)[:, lead : lead + cols.size]
