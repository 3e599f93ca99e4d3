"""Triton ``moe_align``: one launch, one program per expert, no host sync (the spec is ``moe/align.py``).

Program e reads all N*k expert ids twice:
1. a histogram of every expert's pair count, from which it derives its own run's start (the padded counts of
   the experts below it) and length;
2. its own pairs in flat order: a running count plus an in-chunk cumsum gives each pair's rank, which is
   its slot in ``sorted_ids``.
It then writes its padding sentinels, the expert id of its blocks and its first block; program 0 also clears
the unused tail and writes the end of the used blocks.
Every pair is written by exactly one program, so the result does not depend on scheduling. The work is
E * N * k id reads: a few microseconds at decode sizes, ~50 µs for a 8K-token prefill chunk at 384 experts.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

CHUNK = 256
# the pair and block counts follow the batch: unspecialised, so no batch size compiles a variant the warm-up
# did not (a first batch of 8 prompts of 64 tokens compiled one after a warm-up; engine/warmup.py)
BATCH_COUNTS = ("n_pairs", "max_blocks")


@triton.jit(do_not_specialize=BATCH_COUNTS)
def _moe_align_kernel(
    p_idx, p_sorted, p_block_expert, p_first, n_pairs, n_exp, max_blocks,
    BLOCK_M: tl.constexpr, E_PAD: tl.constexpr, CH: tl.constexpr,
):
    e = tl.program_id(0)
    o_c = tl.arange(0, CH)
    b_hist = tl.zeros((E_PAD,), dtype=tl.int32)
    for c0 in range(0, n_pairs, CH):
        o = c0 + o_c
        b_v = tl.load(p_idx + o, mask=o < n_pairs, other=-1).to(tl.int32)
        b_hist += tl.histogram(b_v, E_PAD, mask=(b_v >= 0) & (b_v < n_exp))
    o_b = tl.arange(0, E_PAD)
    b_padded = (b_hist + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    start = tl.sum(tl.where(o_b < e, b_padded, 0))
    mine = tl.sum(tl.where(o_b == e, b_padded, 0))
    total = tl.sum(b_padded)
    tl.store(p_first + e, start // BLOCK_M)
    run = n_pairs * 0
    for c0 in range(0, n_pairs, CH):
        o = c0 + o_c
        b_v = tl.load(p_idx + o, mask=o < n_pairs, other=-1).to(tl.int32)
        b_hit = b_v == e
        b_rank = run + tl.cumsum(b_hit.to(tl.int32), axis=0) - 1
        tl.store(p_sorted + start + b_rank, o, mask=b_hit)
        run += tl.sum(b_hit.to(tl.int32))
    for r0 in range(run, mine, CH):  # this expert's padding: fewer than BLOCK_M sentinels
        o = r0 + o_c
        tl.store(p_sorted + start + o, tl.full((CH,), 0, tl.int32) + n_pairs, mask=o < mine)
    for b0 in range(start // BLOCK_M, (start + mine) // BLOCK_M, CH):
        o = b0 + o_c
        tl.store(p_block_expert + o, tl.full((CH,), 0, tl.int32) + e, mask=o < (start + mine) // BLOCK_M)
    if e == 0:  # the blocks no expert uses
        tl.store(p_first + n_exp, total // BLOCK_M)
        for p0 in range(total, max_blocks * BLOCK_M, CH):
            o = p0 + o_c
            tl.store(p_sorted + o, tl.full((CH,), 0, tl.int32) + n_pairs, mask=o < max_blocks * BLOCK_M)
        for b0 in range(total // BLOCK_M, max_blocks, CH):
            o = b0 + o_c
            tl.store(p_block_expert + o, tl.full((CH,), -1, tl.int32), mask=o < max_blocks)


def moe_align_triton(
    idx: torch.Tensor, n_experts: int, block_m: int, n_blocks: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``idx [N, k]`` (contiguous) -> ``(sorted_ids int32 [n_blocks * block_m], block_expert int32 [n_blocks],
    first_block int32 [n_experts + 1])``."""
    dev = idx.device
    sorted_ids = torch.empty((n_blocks * block_m,), dtype=torch.int32, device=dev)
    block_expert = torch.empty((n_blocks,), dtype=torch.int32, device=dev)
    first_block = torch.zeros((n_experts + 1,), dtype=torch.int32, device=dev)
    if n_blocks:
        _moe_align_kernel[(n_experts,)](
            idx, sorted_ids, block_expert, first_block, idx.numel(), n_experts, n_blocks,
            BLOCK_M=block_m, E_PAD=max(16, triton.next_power_of_2(n_experts)), CH=CHUNK,
        )
    return sorted_ids, block_expert, first_block
