"""Dispatch and combine of expert parallelism: token rows to the ranks that own their experts and back.

Each (token, slot) pair of a routing ``idx [n, k]`` is one row on the wire::

    pair p = row * k + slot,  owner = idx[row, slot] // experts_per_rank
    send   pairs sorted by owner (stable):   [x row | route weight | expert id]   one all_to_all_single
    return the owners' per-pair outputs in the received order                  one all_to_all_single
    unsort back to [n, k, D]; the caller sums the slots in ascending expert id (the spec's order)

Rows travel unquantised (the owner quantises them, per row, exactly as the sender would) in the compute
dtype (fp32, or float64 in the exactness mode). The expert id rides as a float: exact below 2^24. What a rank
receives is the grouped MoE op's input with k = 1 (``x [P_in, D]``, ids and weights ``[P_in, 1]``), whose
per-row output is each pair's expert output, as ``combine`` returns it (expert_parallel_moe.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flashtier.engine.parallel.group_comm import GroupComm


@dataclass(frozen=True)
class Dispatched:
    """What a rank received (rows for its experts) and how to send the answers back."""

    x: torch.Tensor  # [P_in, D] rows, in arrival order
    expert: torch.Tensor  # [P_in] global expert ids (int64)
    weight: torch.Tensor  # [P_in] route weights
    order: torch.Tensor  # [P_out] pair ids (row * k + slot) in the order they were sent
    send_counts: list[int]
    recv_counts: list[int]


def dispatch(comm: GroupComm, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, experts_per_rank: int) -> Dispatched:
    """Send each pair of ``idx [n, k]`` (rows of x [n, D], weights w [n, k]) to the rank owning its expert.

    Collective over ``comm`` (every rank calls it, also with n = 0). Reads its inputs only.
    """
    if x.dtype not in (torch.float32, torch.float64):
        raise ValueError(f"x must be float32 or float64 (the compute dtype), got {x.dtype}")
    n, k = idx.shape
    flat = idx.reshape(-1).long()
    owner = torch.div(flat, experts_per_rank, rounding_mode="floor")
    order = torch.sort(owner, stable=True).indices
    send_counts = torch.bincount(owner, minlength=comm.size).tolist()
    rows = torch.div(order, k, rounding_mode="floor")
    payload = torch.cat((x[rows], w.reshape(-1)[order, None].to(x.dtype), flat[order, None].to(x.dtype)), dim=1)
    got, recv_counts = comm.all_to_all(payload, send_counts)
    d = x.shape[1]
    return Dispatched(got[:, :d], got[:, d + 1].round().long(), got[:, d], order, send_counts, recv_counts)


def combine(comm: GroupComm, sent: Dispatched, out: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """Return the owners' per-pair outputs ``out [P_in, D]`` (in ``sent``'s arrival order) to the senders:
    [n, k, D], slot j of row i = expert idx[i, j]'s output. Collective over ``comm``."""
    back, _ = comm.all_to_all(out, sent.recv_counts, recv_counts=sent.send_counts)
    pairs = back.new_empty((n * k, out.shape[1]))
    pairs[sent.order] = back
    return pairs.view(n, k, out.shape[1])
