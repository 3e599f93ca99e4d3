"""The MoE block with expert parallelism: routed experts partitioned over the EP group (every rank).

Rank r of the EP group holds the whole experts ``[r * E / ep, (r + 1) * E / ep)``. Inside a TP group the
tokens are replicated, so each TP rank takes its own run of the rows (``even_shard``: no token is sent
twice), routes them, and dispatches each (token, expert) pair by all-to-all to the expert's owner, which
runs the spec's expert math (``moe_ffn_reference``, one pair per row) for the pairs it received. The
answers come back by a second all-to-all and are summed per token in ascending expert id, the spec's
order. The shared expert is split over the TP group like a dense layer; the block ends with the same
ONE all-reduce as without EP::

    y_r = shared[slice r](xq)  (+ routed(rows of rank r) on those rows)
    y   = all_reduce_sum over the TP group (y_r)        with tp = 1 no collective: y = routed + shared

Every rank must run the block the same number of times (a data-parallel replica without tokens still
calls it, with N = 0): the all-to-all needs every rank of the group.
"""

from __future__ import annotations

import torch
from torch import nn

from flashtier.engine.model.moe import MoE
from flashtier.engine.parallel.expert_dispatch import combine, dispatch
from flashtier.engine.parallel.group_comm import GroupComm
from flashtier.engine.parallel.shard import even_shard
from flashtier.engine.parallel.sliced_expert import SlicedExpert
from flashtier.kernels.moe.grouped_gemm_reference import act_qdq, combine_reference, moe_ffn_reference
from flashtier.kernels.moe.route import moe_route


class ExpertParallelMoE(nn.Module):
    def __init__(self, moe: MoE, tp: GroupComm, ep: GroupComm):
        """This rank's experts of ``moe`` and its slice of the shared expert (copies; ``moe``'s gate module
        is reused; drop ``moe`` afterwards). ValueError for converted experts or an indivisible count."""
        super().__init__()
        if moe.converted or moe.shared_experts is None:
            raise ValueError("moe: shard the model before converting its experts (moe_convert.convert_experts_)")
        n_experts = len(moe.experts)
        if n_experts % ep.size:
            raise ValueError(f"{ep.size} expert-parallel ranks do not divide the {n_experts} routed experts")
        self.top_k, self.limit = moe.top_k, moe.limit
        self.route_scale, self.gate_temp = moe.route_scale, moe.gate_temp
        self.gate, self.tp, self.ep = moe.gate, tp, ep
        self.owned = even_shard(n_experts, ep.size, ep.index)
        # keyed by the global id: state_dict names stay the checkpoint's (ffn.experts.E.w1.weight)
        self.experts = nn.ModuleDict({str(e): moe.experts[e] for e in range(self.owned.start, self.owned.stop)})
        width = moe.shared_experts.w1.weight.shape[0]
        if width % tp.size:
            raise ValueError(f"--tensor-parallel-size {tp.size} does not divide the shared expert width {width}")
        self.shared_experts = SlicedExpert.from_expert(moe.shared_experts, even_shard(width, tp.size, tp.index), tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, D] (equal on the ranks of a TP group; N may differ between DP replicas, or be 0)
        -> [N, D], the whole MoE output. Collective over the EP group (2 all-to-alls and a count
        exchange) and the TP group (one all-reduce)."""
        x = x if x.dtype == torch.float64 else x.float()
        mine = even_shard(x.shape[0], self.tp.size, self.tp.index)
        routed = self._routed(x[mine.slice])
        y = self.shared_experts.partial(act_qdq(x), None, self.limit) if x.shape[0] else torch.zeros_like(x)
        y[mine.slice] = routed + y[mine.slice]
        return self.tp.all_reduce(y)

    def _routed(self, x: torch.Tensor) -> torch.Tensor:
        """The routed experts' sum for rows x [n, D] (n may be 0)."""
        n, k = x.shape[0], self.top_k
        if n:
            idx, w = moe_route(x, self.gate.weight, self.gate.bias, k, self.route_scale, self.gate_temp,
                               impl="reference")
        else:
            idx, w = torch.zeros(0, k, dtype=torch.int32, device=x.device), x.new_zeros(0, k)
        sent = dispatch(self.ep, x, idx, w, self.owned.size)
        out = torch.zeros_like(sent.x)
        if sent.x.shape[0]:
            experts = self.experts
            out = moe_ffn_reference(sent.x, sent.expert[:, None], sent.weight[:, None],
                                    lambda e: experts[str(e)].weights(), None, self.limit)
        pairs = combine(self.ep, sent, out, n, k)
        return combine_reference(pairs, idx, None)
