"""The MoE block with expert parallelism: routed experts partitioned over the EP group (every rank).

Rank r of the EP group holds the whole experts ``[r * E / ep, (r + 1) * E / ep)``. Inside a TP group the
tokens are replicated. At decode sizes on one host the block is one all-reduce of per-pair rows (below);
otherwise (the all-to-all form drawn here) each TP rank takes its own run of the rows (``even_shard``: no
token is sent twice), routes them, and sends each (token, expert) pair to the expert's owner; the owner runs its experts
on the pairs it received through the grouped MoE op with its subset (``moe_grouped_ffn(..., expert_ids=
the rank's global ids)``, one pair per row), and the per-pair outputs come back to the token's rank, which
sums them in ascending expert id, the spec's order. The shared expert is split over the TP group like a
dense layer; the block ends with the same ONE all-reduce as without EP::

    rank r:  rows of r --route--> pairs --all_to_all--> owner: moe_grouped_ffn(pairs, its stack, expert_ids)
                                                                       |
             y_r = shared[slice r](xq) (+ sum of the returned pairs, ascending id)  <--all_to_all--'
    y   = all_reduce_sum over the TP group (y_r)        with tp = 1 no collective: y = routed + shared

The rank's experts, by form (``convert_experts_`` switches, in place, before the model moves to the GPU):

    float  (loaded, CPU engine, float64 oracle)  nn.ModuleDict of Expert   the op's reference math on them
    stored (the device; ``RankExperts``)         MXFP4 stack + global ids  ``moe_grouped_ffn``: Triton on CUDA
                                                 (+ the shared slice, FP8) (fp32 rows), reference elsewhere

Both run the op's subset semantics (a pair routed to an expert not held contributes nothing), and in
float64 both are the per-expert loop of the spec, so a float64 run is bit-identical to one process.

Two forms, chosen per call from the row count alone (``reduces_pairs``), so every rank of the group picks the
same one:

- **all-reduce of pairs** (decode sizes: at most ``MAX_REDUCED_PAIRS`` pairs, and the EP group is the TP
  group, as on one 8-GPU host at TP 8 / EP 8). The rows are replicated over the group, so every rank routes
  all of them and runs the pairs of its own experts through the grouped op (zero rows for the pairs it does
  not own) and its shared slice; ONE all-reduce of ``[pairs ; shared partial]`` ``[n k + n, D]`` sums them.
  Each pair's row has one non-zero contributor, so it arrives whole (x + 0 = x: exact), and every rank folds
  each token's pairs in ascending expert id and adds the shared sum: the spec's order, float64 bit-identical
  to one process. No count exchange: no host sync, so nothing in the block stops a CUDA-graph capture (what
  vLLM's ``allgather_reducescatter`` backend and DeepEP's low-latency mode are for). It moves (n k + n) D
  fp32 per layer: 7.3 MB at 64 tokens, top-6, D = 4096;
- **all-to-all of pairs** (larger batches, or an EP group spanning DP replicas whose rows differ). Each TP
  rank takes its own run of the rows, routes them and sends each pair to its owner; the owner's outputs come
  back whole and are folded in ascending id, then joined in the block's all-reduce. It moves only the pairs,
  once each way, but needs the per-rank counts on the host (``GroupComm.all_to_all``): a host sync per layer.
  An all-gather of tokens + reduce-scatter of per-token partial sums (cheaper in bytes) would add the ranks'
  partials in the collective's order, which regroups the fold (e.g. a + (b + c)): not the spec's bits.

At prefill sizes the pairs' bytes dominate and the all-to-all moves k times fewer than the all-reduce; at
decode sizes every collective costs its latency and the host sync is the larger cost.

Who runs the shared expert: every rank, on its TP slice, for its TP group's tokens (with tp = 1, the 8-GPU
DP-attention + EP layout, each rank runs the whole shared expert on its own tokens). Its output joins the
routed sum in the all-reduce the block needs anyway: no extra collective, and each rank's work follows its
own token count. Stored, the slice runs through the same op (no routed pair, the FP8 slice as its shared
expert), as one process runs it, unless its FP8 blocks would straddle ranks. One rank running it for everyone
would need every token sent there (another collective
each layer) and would make that rank the straggler of every layer.

Every rank must run the block the same number of times (a data-parallel replica without tokens still
calls it, with N = 0): the all-to-all needs every rank of the group.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from flashtier.engine.model.moe import MoE
from flashtier.engine.parallel.expert_dispatch import combine, dispatch
from flashtier.engine.parallel.group_comm import GroupComm
from flashtier.engine.parallel.shard import even_shard
from flashtier.engine.parallel.sliced_expert import SlicedExpert
from flashtier.kernels.moe.grouped_gemm import moe_grouped_ffn
from flashtier.kernels.moe.grouped_gemm_reference import act_qdq, combine_reference, moe_ffn_reference
from flashtier.kernels.moe.route import moe_route
from flashtier.kernels.moe.weights import FP8Expert, MXFP4Experts
from flashtier.kernels.quant.fp8_weight import as_raw_bytes, quantize_fp8_weight
from flashtier.kernels.quant.mxfp4 import quantize_mxfp4


# The most (token, expert) pairs a batch may have for the all-reduce form (``reduces_pairs``): 64 decode tokens at
# top-6 are 384; the all-reduce then moves (pairs + tokens) rows of D fp32 (7.3 MB at V4.1's D = 4096, ~40 us over
# NVLink), about what the all-to-all form's two legs move, without its count exchange (a host sync).
MAX_REDUCED_PAIRS = 512


class RankExperts(nn.Module):
    """One rank's routed experts on one device in MXFP4 (the layout of ``kernels/moe/weights.py``), stacked in
    ascending global id, and those ids (``expert_ids``, int64): what ``moe_grouped_ffn`` takes for a subset.

    ``impl`` is what the forward passes to the kernels: "auto" (Triton on CUDA, the reference elsewhere);
    tests set "triton" to run the kernels interpreted on the CPU. The buffers are not part of ``state_dict()``
    (a serving form, as ``ExpertWeights``).
    """

    def __init__(self, ids: list[int], dim: int, inter: int, device: torch.device | str):
        super().__init__()
        if not ids or dim % 32 or inter % 32 or dim < 32 or inter < 32:
            raise ValueError(f"RankExperts: needs at least one expert and widths that are multiples of 32, got "
                             f"{len(ids)} experts, dim {dim}, inter {inter}")
        n = len(ids)
        self.impl = "auto"
        for name, shape in (("w13_codes", (n, 2 * inter, dim // 2)), ("w13_scales", (n, 2 * inter, dim // 32)),
                            ("w2_codes", (n, dim, inter // 2)), ("w2_scales", (n, dim, inter // 32))):
            self.register_buffer(name, torch.zeros(shape, dtype=torch.uint8, device=device), persistent=False)
        self.register_buffer("expert_ids", torch.tensor(ids, dtype=torch.int64, device=device), persistent=False)

    @classmethod
    @torch.no_grad()
    def from_float(cls, experts: Mapping[int, nn.Module], device: torch.device | str) -> "RankExperts":
        """Quantise float experts (global id -> module with ``w1/w2/w3`` Linear layers) onto ``device``, one
        weight matrix at a time in fp32 there (what ``ExpertWeights.from_float`` does for the routed experts;
        lossless for weights snapped to MXFP4). Reads the modules only; ValueError on unequal shapes."""
        ids = sorted(experts)
        inter, dim = experts[ids[0]].w1.weight.shape
        out = cls(ids, dim, inter, device)
        for j, e in enumerate(ids):
            ex = experts[e]
            if (ex.w1.weight.shape, ex.w3.weight.shape, ex.w2.weight.shape) != ((inter, dim), (inter, dim),
                                                                                (dim, inter)):
                raise ValueError(f"RankExperts.from_float: expert {e} has shapes unlike expert {ids[0]}'s")
            for rows, w in ((slice(0, inter), ex.w1.weight), (slice(inter, 2 * inter), ex.w3.weight)):
                out.w13_codes[j, rows], out.w13_scales[j, rows] = quantize_mxfp4(w.to(device, torch.float32))
            out.w2_codes[j], out.w2_scales[j] = quantize_mxfp4(ex.w2.weight.to(device, torch.float32))
        return out

    @torch.no_grad()
    def add_shared_(self, shared: nn.Module) -> None:
        """Hold ``shared`` (a module with ``w1/w2/w3`` Linear layers: the rank's slice of the shared expert, its
        width a multiple of 32) in FP8 (``kernels/moe/weights.py``'s FP8Expert layout), quantised on this
        device; mutates self. Lossless for weights snapped to FP8."""
        dev = self.w13_codes.device
        parts = [quantize_fp8_weight(w.to(dev, torch.float32)) for w in (shared.w1.weight, shared.w3.weight)]
        w2 = quantize_fp8_weight(shared.w2.weight.to(dev, torch.float32))
        for name, t in (("s13_codes", torch.cat([as_raw_bytes(q) for q, _ in parts])),
                        ("s13_scales", torch.cat([as_raw_bytes(sc) for _, sc in parts])),
                        ("s2_codes", as_raw_bytes(w2[0])), ("s2_scales", as_raw_bytes(w2[1]))):
            self.register_buffer(name, t.contiguous(), persistent=False)

    def routed(self) -> MXFP4Experts:
        return MXFP4Experts(self.w13_codes, self.w13_scales, self.w2_codes, self.w2_scales)

    def shared(self) -> FP8Expert | None:
        """The shared expert's slice in FP8 (``add_shared_``), or None when not held here."""
        if not hasattr(self, "s13_codes"):
            return None
        return FP8Expert(self.s13_codes, self.s13_scales, self.s2_codes, self.s2_scales)

    @property
    def nbytes(self) -> int:
        """Bytes of the routed experts resident on the device (the ids and the shared slice not counted)."""
        return sum(t.numel() for t in self.routed())

    def extra_repr(self) -> str:
        ids = self.expert_ids.tolist()
        return f"experts={ids[0]}..{ids[-1]} ({len(ids)}), {self.nbytes / 2**20:.1f} MiB on {self.w13_codes.device}"


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
        self.max_reduced_pairs = MAX_REDUCED_PAIRS
        self.owned = even_shard(n_experts, ep.size, ep.index)
        # float: keyed by the global id, so state_dict names stay the checkpoint's (ffn.experts.E.w1.weight);
        # RankExperts once converted (convert_experts_)
        self.experts: nn.Module = nn.ModuleDict(
            {str(e): moe.experts[e] for e in range(self.owned.start, self.owned.stop)})
        width = moe.shared_experts.w1.weight.shape[0]
        if width % tp.size:
            raise ValueError(f"--tensor-parallel-size {tp.size} does not divide the shared expert width {width}")
        self.shared_experts = SlicedExpert.from_expert(moe.shared_experts, even_shard(width, tp.size, tp.index), tp)

    @property
    def converted(self) -> bool:
        """True once the routed experts are a ``RankExperts`` (MXFP4, the device path)."""
        return isinstance(self.experts, RankExperts)

    @torch.no_grad()
    def convert_experts_(self, device: torch.device | str) -> int:
        """Put this rank's routed experts into their stored format (MXFP4) on ``device``, in place, and drop
        the float ones; the shared expert's slice too (FP8, through the same op) when its FP8 blocks do not
        straddle ranks (slice start and width multiples of 32), else it stays float (``SlicedExpert``, whose
        quantisation exchanges the straddling blocks). Returns the bytes now resident for the experts. A
        second call changes nothing. ValueError on unequal expert shapes."""
        if not self.converted:
            self.experts = RankExperts.from_float({int(e): m for e, m in self.experts.items()}, device)
            sh = self.shared_experts
            if sh.inter.start % 32 == 0 and sh.inter.size % 32 == 0:
                self.experts.add_shared_(sh)
                self.shared_experts = None
        shared = self.experts.shared()
        return self.experts.nbytes + (sum(t.numel() for t in shared) if shared is not None else 0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, D] (equal on the ranks of a TP group; N may differ between DP replicas, or be 0)
        -> [N, D], the whole MoE output. Collective: ``reduces_pairs(N)`` one all-reduce over the TP group
        (= the EP group) and no host sync; else two all-to-alls and a count exchange over the EP group (a host
        sync) and one all-reduce over the TP group."""
        x = x if x.dtype == torch.float64 else x.float()
        if self.reduces_pairs(x.shape[0]):
            return self._forward_reduced(x)
        mine = even_shard(x.shape[0], self.tp.size, self.tp.index)
        routed = self._routed(x[mine.slice])
        y = self._shared(x) if x.shape[0] else torch.zeros_like(x)
        y[mine.slice] = routed + y[mine.slice]
        return self.tp.all_reduce(y)

    def reduces_pairs(self, n: int) -> bool:
        """Whether a batch of ``n`` rows runs the all-reduce form (module docstring): the EP group is the TP
        group (so every rank holds every row, and every rank of the group decides alike from the same ``n``)
        and the batch has at most ``max_reduced_pairs`` (token, expert) pairs."""
        return self.ep.ranks == self.tp.ranks and n * self.top_k <= self.max_reduced_pairs

    def _forward_reduced(self, x: torch.Tensor) -> torch.Tensor:
        """The all-reduce form: every rank routes all n rows, runs the pairs of its experts (zero rows for the
        others' pairs) and its shared slice; one all-reduce of ``[pairs ; shared partial]`` gives every rank
        each pair's output whole (one rank's row plus zeros: exact) and the shared sum; the combine then folds
        each token's pairs in ascending expert id and adds the shared expert, the spec's order."""
        n, k, d = x.shape[0], self.top_k, x.shape[1]
        if n == 0:  # the whole group is idle (it decides alike): no collective
            return torch.zeros_like(x)
        idx, w = self._route(x)
        pairs = self._pairs(x.repeat_interleave(k, dim=0), idx.reshape(-1).long(), w.reshape(-1))
        both = self.tp.all_reduce(torch.cat((pairs, self._shared(x))))
        return combine_reference(both[: n * k].view(n, k, d), idx, both[n * k :])

    def _shared(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's slice of the shared expert on rows x [N, D] (N > 0): a partial sum over the TP group."""
        if self.shared_experts is not None:
            return self.shared_experts.partial(act_qdq(x), None, self.limit)
        # stored: the op with no routed pair (id -1 is held by no stack) and the FP8 slice as its shared expert
        rx = self.experts
        none = torch.full((x.shape[0], 1), -1, dtype=torch.int32, device=x.device)
        return moe_grouped_ffn(x, none, x.new_zeros(x.shape[0], 1), rx.routed(), rx.shared(), self.limit,
                               expert_ids=rx.expert_ids, impl=rx.impl)

    def _route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(expert ids, route weights) ``[n, k]`` of rows x [n, D] (n may be 0)."""
        k = self.top_k
        if not x.shape[0]:
            return torch.zeros(0, k, dtype=torch.int32, device=x.device), x.new_zeros(0, k)
        impl = self.experts.impl if self.converted else "reference"
        return moe_route(x, self.gate.weight, self.gate.bias, k, self.route_scale, self.gate_temp, impl=impl)

    def _routed(self, x: torch.Tensor) -> torch.Tensor:
        """The routed experts' sum for rows x [n, D] (n may be 0), through the all-to-all dispatch."""
        n, k = x.shape[0], self.top_k
        idx, w = self._route(x)
        sent = dispatch(self.ep, x, idx, w, self.owned.size)
        out = self._pairs(sent.x, sent.expert, sent.weight) if sent.x.shape[0] else torch.zeros_like(sent.x)
        pairs = combine(self.ep, sent, out, n, k)
        return combine_reference(pairs, idx, None)

    def _pairs(self, rows: torch.Tensor, expert: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """Each pair's expert output, [P, D], for pairs given as rows ``[P, D]``, global expert ids ``[P]`` and
        route weights ``[P]``: the pairs as rows of k = 1 through the grouped op with this rank's subset (a
        pair for an expert not held gives a zero row)."""
        ids, w = expert[:, None], weight[:, None]
        if self.converted:
            rx = self.experts
            return moe_grouped_ffn(rows, ids, w, rx.routed(), None, self.limit, expert_ids=rx.expert_ids,
                                   impl=rx.impl)
        # float weights: what the op's reference path runs for a subset (moe_grouped_ffn_reference), on them
        experts = self.experts
        held = torch.tensor(sorted(int(e) for e in experts), dtype=ids.dtype, device=ids.device)
        ids = torch.where(torch.isin(ids, held), ids, torch.full_like(ids, -1))
        return moe_ffn_reference(rows, ids, w, lambda e: experts[str(e)].weights(), None, self.limit)
