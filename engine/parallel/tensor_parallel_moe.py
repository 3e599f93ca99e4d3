"""The MoE block without expert parallelism: every expert split over the TP group (intermediate dim).

Every rank of the TP group holds the same tokens (the replicated residual stream), routes them the same
way (the gate is replicated), runs its slice of each chosen expert and of the shared expert, and the
block ends with ONE all-reduce of the summed partials::

    y_r = sum_e  expert_e[slice r](xq, w_e)  +  shared[slice r](xq)         e ascending, as the spec
    y   = all_reduce_sum(y_r)

Same math as ``MoE.forward`` on float weights (``moe_ffn_reference``); only the summation order of the
partials differs (float rounding). The routing, hence the sequence of collectives, is identical on
every rank because their inputs are bit-identical (they come out of the same all-reduce).
"""

from __future__ import annotations

import torch
from torch import nn

from flashtier.engine.model.moe import MoE
from flashtier.engine.parallel.group_comm import GroupComm
from flashtier.engine.parallel.shard import even_shard
from flashtier.engine.parallel.sliced_expert import SlicedExpert
from flashtier.kernels.moe.grouped_gemm_reference import act_qdq
from flashtier.kernels.moe.route import moe_route


class TensorParallelMoE(nn.Module):
    def __init__(self, moe: MoE, comm: GroupComm):
        """Slices of ``moe``'s experts for rank ``comm.index`` (``moe``'s gate module is reused, its experts
        are copied: drop ``moe`` afterwards). ValueError for converted experts or an indivisible width."""
        super().__init__()
        if moe.converted or moe.shared_experts is None:
            raise ValueError("moe: shard the model before converting its experts (moe_convert.convert_experts_)")
        self.top_k, self.limit = moe.top_k, moe.limit
        self.route_scale, self.gate_temp = moe.route_scale, moe.gate_temp
        self.gate, self.comm = moe.gate, comm

        def sliced(expert: nn.Module) -> SlicedExpert:
            full = expert.w1.weight.shape[0]
            if full % comm.size:
                raise ValueError(f"--tensor-parallel-size {comm.size} does not divide the expert width {full}")
            return SlicedExpert.from_expert(expert, even_shard(full, comm.size, comm.index), comm)

        self.experts = nn.ModuleList(sliced(e) for e in moe.experts)
        self.shared_experts = sliced(moe.shared_experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, D] (equal on every rank of the group) -> [N, D], the whole MoE output on every rank.

        A fixed set of collectives whatever the routing: at most one amax exchange for all routed
        activations, one for the shared expert's, and the final all-reduce.
        """
        idx, w = moe_route(x, self.gate.weight, self.gate.bias, self.top_k, self.route_scale, self.gate_temp,
                           impl="reference")
        xq = act_qdq(x if x.dtype == torch.float64 else x.float())
        y = torch.zeros_like(xq)
        chosen = []
        for e in torch.unique(idx).tolist():  # ascending, the spec's order
            rows, slot = torch.nonzero(idx == e, as_tuple=True)
            chosen.append((e, rows, self.experts[e].activation(xq[rows], w[rows, slot], self.limit)))
        if chosen:
            # every slice has the same columns, so one quantisation call covers all chosen experts' rows
            acts = self.experts[chosen[0][0]].quantize(torch.cat([a for _, _, a in chosen]))
            for (e, rows, _), act_q in zip(chosen, acts.split([r.numel() for _, r, _ in chosen])):
                y.index_add_(0, rows, self.experts[e].down(act_q))
        y = y + self.shared_experts.partial(xq, None, self.limit)
        return self.comm.all_reduce(y)
