"""One SwiGLU expert split over a tensor-parallel group along its intermediate dim.

Rank r holds rows ``inter`` of w1 (gate) and w3 (up) and the same columns of w2 (down): column- then
row-parallel, so the rank's output is a partial sum and the caller all-reduces (once for the whole MoE
block, see ``tensor_parallel_moe.py``). The math is the spec's ``expert_ffn_reference``
(kernels/moe/grouped_gemm_reference.py) on the slice; the one difference is the FP8 quantisation of w2's
input, whose 32-blocks may straddle ranks (``column_quant.py``). Parameter names stay the checkpoint's
(``w1`` / ``w2`` / ``w3``): a sharded loader fills them with its slice of each tensor.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from flashtier.engine.model.moe import Expert
from flashtier.engine.model.sharded_reader import TensorSlice
from flashtier.engine.parallel.column_quant import column_shard_qdq
from flashtier.engine.parallel.group_comm import GroupComm
from flashtier.engine.parallel.shard import Shard


def _up(x: torch.Tensor) -> torch.Tensor:
    return x if x.dtype == torch.float64 else x.float()


class SlicedExpert(Expert):
    def __init__(self, dim: int, inter: Shard, full_inter: int, comm: GroupComm, dtype: torch.dtype):
        super().__init__(dim, inter.size, dtype)
        self.inter, self.full_inter, self.comm = inter, full_inter, comm

    @classmethod
    @torch.no_grad()
    def from_expert(cls, expert: Expert, inter: Shard, comm: GroupComm) -> "SlicedExpert":
        """A new module holding copies of ``expert``'s slice ``inter`` (``expert`` is not modified)."""
        full, dim = expert.w1.weight.shape
        if inter.start < 0 or inter.stop > full or inter.size < 1:
            raise ValueError(f"inter {inter} must be a non-empty slice of the {full}-wide intermediate dim")
        with torch.device(expert.w1.weight.device):  # also on "meta": a shard planned before any load
            out = cls(dim, inter, full, comm, expert.w1.weight.dtype)
        out.w1.weight.copy_(expert.w1.weight[inter.slice])
        out.w3.weight.copy_(expert.w3.weight[inter.slice])
        out.w2.weight.copy_(expert.w2.weight[:, inter.slice])
        return out

    def checkpoint_slices(self, prefix: str) -> dict[str, TensorSlice]:
        """The parts of the checkpoint's tensors this slice holds, by name (``prefix``: the module's name):
        rows ``inter`` of w1 and w3, the same columns of w2 (``from_expert``'s cut)."""
        rows, cols = TensorSlice(0, self.inter.start, self.inter.size), TensorSlice(1, self.inter.start, self.inter.size)
        return {f"{prefix}.w1.weight": rows, f"{prefix}.w3.weight": rows, f"{prefix}.w2.weight": cols}

    def activation(self, xq: torch.Tensor, route_w: torch.Tensor | None, limit: float) -> torch.Tensor:
        """w2's input on this rank's slice, before its quantisation: [n, inter.size] for quantised rows xq [n, D].

        ``route_w [n]`` scales it (the spec applies the routing weight before w2; None: the shared expert).
        """
        a = _up(F.linear(xq.to(self.w1.weight.dtype), self.w1.weight))
        b = _up(F.linear(xq.to(self.w3.weight.dtype), self.w3.weight))
        act = F.silu(a.clamp(max=limit)) * b.clamp(-limit, limit)
        return act if route_w is None else route_w[:, None].to(act.dtype) * act

    def quantize(self, act: torch.Tensor) -> torch.Tensor:
        """w2's FP8 input quantisation of ``activation`` rows (collective when blocks straddle ranks)."""
        return column_shard_qdq(act, self.inter, self.full_inter, self.comm)

    def down(self, act_q: torch.Tensor) -> torch.Tensor:
        """w2 on this rank's columns: [n, D], a partial sum over the group."""
        return _up(F.linear(act_q.to(self.w2.weight.dtype), self.w2.weight))

    def partial(self, xq: torch.Tensor, route_w: torch.Tensor | None, limit: float) -> torch.Tensor:
        """This rank's share of the expert on quantised rows xq [n, D]: [n, D] to be summed over the group.

        Collective over the group when w2's input blocks straddle ranks. Reads the weights only.
        """
        return self.down(self.quantize(self.activation(xq, route_w, limit)))
