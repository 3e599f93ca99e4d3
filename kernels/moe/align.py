"""Token-expert pairs sorted by expert and padded per expert to whole M tiles, on the device (no host sync).

For ``idx [N, k]`` (expert of each of a token's k slots) the grouped GEMM needs, per M tile of ``block_m``
rows, one expert and the pairs it serves. A pair is its flat id ``f = token * k + slot``::

    expert 0: f f f - | expert 2: f f f f | f - - - | expert 3: f - - - | (unused blocks) ...
              block 0 |           block 1 | block 2 |           block 3 |

- ``sorted_ids int32 [max_blocks * block_m]``: experts in ascending order, each expert's pairs in ascending
  flat id, each expert's run padded with the sentinel ``N * k`` to a multiple of block_m (an expert with
  no pair has no block). Entries past the last used block are the sentinel too.
- ``block_expert int32 [max_blocks]``: the expert of each block, -1 for unused blocks (kernels skip them).
- ``first_block int32 [E + 1]``: expert e's blocks are ``[first_block[e], first_block[e + 1])`` (empty when it
  has no pair); ``first_block[E]`` is the number of used blocks. The grouped GEMM runs one program per expert
  over these blocks, so it reads the expert's weights once whatever the number of its blocks.
- ``max_blocks = N*k // block_m + min(E, N*k)``: the most blocks any routing can need (each expert
  wastes less than one block), so buffers and grids are sized without reading the counts back.

``impl="auto"`` runs the Triton kernel (``moe/align_kernel.py``, one launch) on CUDA and the reference
below otherwise. Both give identical tensors. Expert ids must lie in [0, E): the reference raises
ValueError otherwise; the Triton path (which cannot look without a host sync) drops such a pair.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from flashtier.kernels.moe.align_kernel import moe_align_triton
from flashtier.kernels.quant.common import resolve_impl

_OP = "moe_align"


class MoEAlignment(NamedTuple):
    """Result of :func:`moe_align` (see the module docstring)."""

    sorted_ids: torch.Tensor  # int32 [max_blocks * block_m]
    block_expert: torch.Tensor  # int32 [max_blocks]
    block_m: int
    n_pairs: int  # N * k: the padding sentinel
    first_block: torch.Tensor  # int32 [E + 1]: expert e's blocks are [first_block[e], first_block[e + 1])


def max_blocks(n_pairs: int, n_experts: int, block_m: int) -> int:
    """Upper bound on the M tiles of any routing of ``n_pairs`` pairs over ``n_experts`` experts."""
    return n_pairs // block_m + min(n_experts, n_pairs)


def moe_align(idx: torch.Tensor, n_experts: int, block_m: int, *, impl: str = "auto") -> MoEAlignment:
    """Sort the pairs of ``idx [N, k]`` (int32/int64 expert ids) by expert into ``block_m``-row tiles.

    Example::

        al = moe_align(torch.tensor([[2, 0], [2, 3]]), n_experts=4, block_m=4)
        # al.sorted_ids == [1, 4, 4, 4,  0, 2, 4, 4,  3, 4, 4, 4,  4, 4, 4, 4, ...], block_expert == [0, 2, 3, -1, ...]
        # al.first_block == [0, 1, 1, 2, 3]
    """
    if not isinstance(idx, torch.Tensor) or idx.dim() != 2 or idx.dtype not in (torch.int32, torch.int64):
        got = f"{idx.dtype} {list(idx.shape)}" if isinstance(idx, torch.Tensor) else type(idx).__name__
        raise ValueError(f"{_OP}: idx must be a 2-D int32/int64 tensor [N, k], got {got}")
    if isinstance(n_experts, bool) or not isinstance(n_experts, int) or not 1 <= n_experts <= 4096:
        raise ValueError(f"{_OP}: n_experts must be an int in [1, 4096], got {n_experts!r}")
    if isinstance(block_m, bool) or not isinstance(block_m, int) or block_m < 1 or block_m & (block_m - 1):
        raise ValueError(f"{_OP}: block_m must be a positive power of two, got {block_m!r}")
    impl = resolve_impl(impl, idx, _OP)
    if impl == "reference":
        return _reference_moe_align(idx, n_experts, block_m)
    sorted_ids, block_expert, first_block = moe_align_triton(idx.contiguous(), n_experts, block_m,
                                                             max_blocks(idx.numel(), n_experts, block_m))
    return MoEAlignment(sorted_ids, block_expert, block_m, idx.numel(), first_block)


def _reference_moe_align(idx: torch.Tensor, n_experts: int, block_m: int) -> MoEAlignment:
    """The spec in plain torch (it reads counts back to the host; the Triton path does not)."""
    flat = idx.reshape(-1).long()
    n_pairs = flat.numel()
    if n_pairs and (int(flat.min()) < 0 or int(flat.max()) >= n_experts):
        raise ValueError(f"{_OP}: expert ids must lie in [0, {n_experts}), got [{int(flat.min())}, {int(flat.max())}]")
    nb = max_blocks(n_pairs, n_experts, block_m)
    dev = idx.device
    sorted_ids = torch.full((nb * block_m,), n_pairs, dtype=torch.int32, device=dev)
    block_expert = torch.full((nb,), -1, dtype=torch.int32, device=dev)
    counts = torch.bincount(flat, minlength=n_experts)
    padded = (counts + block_m - 1) // block_m * block_m
    starts = torch.cumsum(padded, 0) - padded
    order = torch.sort(flat, stable=True).indices  # by expert, ascending flat id within an expert
    experts = flat[order]
    rank = torch.arange(n_pairs, device=dev) - (torch.cumsum(counts, 0) - counts)[experts]
    sorted_ids[starts[experts] + rank] = order.to(torch.int32)
    used = int(padded.sum()) // block_m
    block_expert[:used] = torch.repeat_interleave(torch.arange(n_experts, device=dev), padded // block_m).int()
    first_block = torch.zeros(n_experts + 1, dtype=torch.int32, device=dev)
    first_block[1:] = torch.cumsum(padded // block_m, 0).int()
    return MoEAlignment(sorted_ids, block_expert, block_m, n_pairs, first_block)
