"""The collectives a sharded model calls, over one process group.

A group of one rank runs none of them (every call returns its input), so a sharded layer has one
code path whatever the split. Every rank of a group must make the same calls in the same order, with
tensors of the same dtype (and, where said, shape); a rank that does not blocks the others until the
process group's timeout, which then raises.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist


class GroupComm:
    def __init__(self, ranks: Sequence[int], rank: int, group: dist.ProcessGroup | None = None):
        """``ranks``: the global ranks of the group, in group order; ``rank``: this process's global rank;
        ``group``: the process group (None only for a group of one rank)."""
        ranks = tuple(ranks)
        if rank not in ranks:
            raise ValueError(f"rank {rank} is not in the group {ranks}")
        if group is None and len(ranks) > 1:
            raise ValueError(f"group: a group of {len(ranks)} ranks needs a process group")
        self.ranks, self.rank, self.group = ranks, rank, group
        self.index = ranks.index(rank)

    @property
    def size(self) -> int:
        return len(self.ranks)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over the group. Reduces ``x`` in place when it is contiguous; use the returned tensor."""
        if self.size == 1:
            return x
        x = x.contiguous()
        dist.all_reduce(x, group=self.group)
        return x

    def all_reduce_max(self, x: torch.Tensor) -> torch.Tensor:
        """Element-wise max over the group (in place when contiguous; use the returned tensor)."""
        if self.size == 1:
            return x
        x = x.contiguous()
        dist.all_reduce(x, op=dist.ReduceOp.MAX, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """Every rank's ``x`` (same shape on all) concatenated along ``dim`` in group order."""
        if self.size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x, group=self.group)
        return torch.cat(parts, dim=dim)

    def all_to_all(
        self, x: torch.Tensor, send_counts: Sequence[int], recv_counts: Sequence[int] | None = None
    ) -> tuple[torch.Tensor, list[int]]:
        """Rows ``x[sum(send_counts[:j]) : ... + send_counts[j]]`` go to group member j; returns the rows
        received (from member 0 first) and how many came from each member.

        ``recv_counts``, when the caller knows them (the return leg of a dispatch), saves the count
        exchange. Needs ``sum(send_counts) == x.shape[0]`` (ValueError otherwise). Reads the counts on
        the host: a device synchronisation on CUDA.
        """
        send_counts = [int(c) for c in send_counts]
        if len(send_counts) != self.size or sum(send_counts) != x.shape[0]:
            raise ValueError(f"send_counts {send_counts} must have {self.size} entries summing to {x.shape[0]}")
        if self.size == 1:
            return x, send_counts
        if recv_counts is None:
            sent = torch.tensor(send_counts, dtype=torch.int64, device=x.device)
            got = torch.empty_like(sent)
            dist.all_to_all_single(got, sent, group=self.group)
            recv_counts = got.tolist()
        recv_counts = [int(c) for c in recv_counts]
        out = x.new_empty((sum(recv_counts), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), recv_counts, send_counts, group=self.group)
        return out, recv_counts
