"""Rank 0 of a TP x EP split emulated on one device: its decode step measured, its collectives priced.

The real V4.1-Flash needs one 8-GPU host (TP 8 + EP 8). On one GPU this builds rank 0's share of the model in
its real formats (``random_rank_model``: its heads, vocabulary rows, shared-expert slice and 1/8 of the routed
experts in MXFP4, drawn on the GPU; the Engram tables a sparse file-backed mapping, so untouched rows take no
host memory) and runs the engine's decode step on it at batch 1 / 8 / 64. The seven peers do not exist:

- every collective of the TP / EP groups (``PricedComm``) returns at once with a tensor of the right shape
  (this rank's data standing in for the peers') and is recorded with its bytes;
- the MoE block (``EmulatedExpertParallelMoE``) routes the WHOLE batch (replicated over the TP group, so rank
  0 sees every token), keeps the (token, expert) pairs whose expert rank 0 owns, pads them to the most loaded
  rank's count (the step waits for the slowest rank; ``--load rank0`` keeps rank 0's own), and runs them
  through the grouped MoE op with rank 0's expert subset. At decode sizes the real block is one all-reduce of
  per-pair rows (``ExpertParallelMoE.reduces_pairs``, no host sync), priced as such; above them, two
  all-to-alls and a count exchange, a host synchronisation. The padding reads the counts on the host
  (``.tolist()``) in both cases: a sync per layer that the real all-reduce form does not have;
- the recorded collectives are priced by a latency + bandwidth model of the NVLink host (multicast off):
  ``alpha + wire bytes / bandwidth`` per call (all-reduce: a ring's 2 (p-1)/p of the buffer; all-gather
  (p-1)/p of the output; all-to-all (p-1)/p of the larger of sent and received). ``--alpha-us`` and
  ``--link-GBps`` set the model; they are assumptions, stated in the output, not measurements.

    projected step = measured step on the one device (no collectives run) + priced collectives

The projection leaves out the overlap a real run could get and the skew between ranks beyond the MoE's most
loaded rank. Decode steps run eager, as the real TP engine runs them today (rank_engine.py turns CUDA graphs
off under TP). ``--graphs`` adds, per batch, the same steps replayed from CUDA graphs: both rows then run the
MoE block's own forward on rank 0's pairs (no padding, so no host sync: the all-reduce form is capturable), and
the graph row prices the eager row's recorded collectives (a replay records none). That row projects what TP
with graphs would give.

Usage (one GPU; flashtier importable, TRITON_INTERPRET=0):
    python3 -P benchmarks/rank0_emulation.py --preset v4.1-flash --tp 8 --batches 1,8,64 --json docs/perf/multi_gpu.json
    python3 -P benchmarks/rank0_emulation.py --preset v4.1-flash --tp 8 --batches 1,8,64 --graphs --json OUT.json
On the CPU (a check of the mechanics, not a timing):
    python3 -P benchmarks/rank0_emulation.py --preset tiny --override '{"n_routed_experts": 32, "o_groups": 4}' \
        --tp 4 --batches 1,4 --device cpu --dtype float32 --steps 2
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import time
from dataclasses import dataclass, field

import torch

from flashtier.engine.config import EngineConfig
from flashtier.engine.engine import Engine
from flashtier.engine.model.config import preset
from flashtier.engine.parallel import ParallelConfig, ParallelGroups
from flashtier.engine.parallel.expert_parallel_moe import ExpertParallelMoE
from flashtier.engine.parallel.rank_random import random_rank_model
from flashtier.engine.sample.params import SamplingParams
from flashtier.kernels.moe.grouped_gemm import moe_grouped_ffn
from flashtier.kernels.moe.route import moe_route
from flashtier.kvstore.config import KVStoreConfig

BLOCK = 64
# SGLang's published DeepSeek-V4-Flash decode figures (ms per output token at batch 1), for the table
SGLANG_V4_FLASH_MS = {"8xH100, MTP": 3.22, "4xH200": 3.37}


@dataclass
class LinkModel:
    """Latency + bandwidth of one collective on the host's NVLink (multicast off)."""

    alpha_s: float
    bytes_per_s: float

    def price(self, kind: str, nbytes: int, p: int) -> float:
        share = {"all_reduce": 2 * (p - 1) / p, "all_gather": (p - 1) / p, "all_to_all": (p - 1) / p}[kind]
        return self.alpha_s + share * nbytes / self.bytes_per_s


@dataclass
class CallLog:
    calls: list[tuple[str, int]] = field(default_factory=list)

    def priced_s(self, link: LinkModel, p: int) -> float:
        return sum(link.price(kind, nbytes, p) for kind, nbytes in self.calls)


class PricedComm:
    """``GroupComm``'s interface for rank ``index`` of ``size`` ranks that do not exist (module docstring)."""

    def __init__(self, size: int, index: int, log: CallLog) -> None:
        self.ranks, self.rank, self.index, self.group, self.log = tuple(range(size)), index, index, None, log

    @property
    def size(self) -> int:
        return len(self.ranks)

    def _record(self, kind: str, nbytes: int) -> None:
        if self.size > 1:
            self.log.calls.append((kind, nbytes))

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        self._record("all_reduce", x.numel() * x.element_size())
        return x

    def all_reduce_max(self, x: torch.Tensor) -> torch.Tensor:
        return self.all_reduce(x)

    def all_gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        self._record("all_gather", x.numel() * x.element_size() * self.size)
        return torch.cat([x] * self.size, dim=dim) if self.size > 1 else x

    def all_to_all(self, x, send_counts, recv_counts=None):
        self._record("all_to_all", x.numel() * x.element_size())
        return x, [int(c) for c in send_counts]


class EmulatedExpertParallelMoE(ExpertParallelMoE):
    """Rank 0's MoE block with the whole batch's routing (module docstring); ``most_loaded`` pads rank 0's
    pairs to the largest count any rank gets."""

    most_loaded = True
    real_forward = False  # --graphs: the block's own forward (rank 0's pairs; no host sync, so capturable)
    pairs_seen: list[tuple[int, int]] = []  # (rank 0's pairs, the most loaded rank's) per call

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.real_forward:
            return super().forward(x)
        x = x if x.dtype == torch.float64 else x.float()
        n, k, per = x.shape[0], self.top_k, self.owned.size
        if n == 0:
            return self.tp.all_reduce(torch.zeros_like(x))
        rx = self.experts
        idx, w = moe_route(x, self.gate.weight, self.gate.bias, k, self.route_scale, self.gate_temp, impl=rx.impl)
        owner = idx.long().flatten() // per
        counts = torch.bincount(owner, minlength=self.ep.size).tolist()  # the real dispatch's host sync
        mine = (owner == self.ep.index).nonzero().squeeze(1)
        target = max(counts) if self.most_loaded else counts[self.ep.index]
        EmulatedExpertParallelMoE.pairs_seen.append((counts[self.ep.index], max(counts)))
        if target > mine.numel():  # stand-ins for the busiest rank's extra pairs: rank 0's own expert 0 rows
            extra = target - mine.numel()
            pad = torch.full((extra,), -1, dtype=torch.long, device=x.device)
            mine = torch.cat((mine, pad))
        rows = torch.where(mine >= 0, mine // k, torch.zeros_like(mine))
        ids = torch.where(mine >= 0, idx.flatten().long()[mine.clamp(min=0)], rx.expert_ids[0].expand_as(mine))
        ws = torch.where(mine >= 0, w.flatten()[mine.clamp(min=0)], torch.ones_like(mine, dtype=w.dtype))
        out = moe_grouped_ffn(x[rows], ids[:, None].int(), ws[:, None].to(w.dtype), rx.routed(), None, self.limit,
                              expert_ids=rx.expert_ids, impl=rx.impl)
        y = self._shared(x)
        real = mine >= 0
        y.index_add_(0, rows[real], out[real])
        row_bytes = x.shape[1] * x.element_size()
        if self.reduces_pairs(n):  # the all-reduce form: one all-reduce of [pairs ; shared partial], no dispatch
            self.tp._record("all_reduce", (n * k + n) * row_bytes)
            return y
        # the all-to-all form. The wire: rank 0's own rows' pairs out (its 1/tp of the batch), the pairs for its
        # experts in, as the real dispatch's payload [x | weight | id] and combine's [out]; then the all-reduce
        sent = -(-n // self.tp.size) * k
        self.ep._record("all_to_all", max(sent, target) * (row_bytes + 2 * x.element_size()))
        self.ep._record("all_to_all", max(sent, target) * row_bytes)
        return self.tp.all_reduce(y)


def build_rank0(cfg, tp: int, device: torch.device, dtype: torch.dtype, log: CallLog, seed: int):
    config = ParallelConfig(tensor_parallel_size=tp, expert_parallel=True)
    comm = PricedComm(tp, 0, log)
    groups = ParallelGroups(config, 0, comm, comm)
    model = random_rank_model(cfg, groups, device, seed=seed, dtype=dtype, sparse_tables=True)
    for module in model.modules():
        if type(module) is ExpertParallelMoE:
            module.__class__ = EmulatedExpertParallelMoE
    return model


def run_batch(model, batch: int, prompt: int, steps: int, device: torch.device, dtype: str, log: CallLog,
              link: LinkModel, tp: int, graphs: bool = False, step_calls: list | None = None) -> dict:
    """One batch's decode steps, timed; each step's recorded collectives priced. With ``graphs`` the steps
    replay a CUDA graph, so nothing is recorded while they run: ``step_calls`` (an eager step's calls at the
    same batch) are priced instead."""
    cfg = model.cfg
    blocks = batch * (-(-(prompt + steps + 8) // BLOCK) + 1) + 8
    ecfg = EngineConfig(device=str(device), dtype=dtype, forward="batched", max_num_seqs=batch,
                        max_num_batched_tokens=4096, cuda_graphs=graphs)
    engine = Engine(model, ecfg, KVStoreConfig(block_size=BLOCK, num_blocks=blocks), tiers=None)
    params = SamplingParams(temperature=0, max_tokens=steps + 8, ignore_eos=True)
    g = torch.Generator().manual_seed(batch)
    for i in range(batch):
        engine.add_request(f"r{i}", torch.randint(3, cfg.vocab_size - 1, (prompt,), generator=g).tolist(), params)
    while sum(1 for r in engine.requests.values() for s in r.seqs if s.output) < batch:
        engine.step()
    engine.step()
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    times, priced, recorded = [], [], []
    EmulatedExpertParallelMoE.pairs_seen.clear()
    for _ in range(steps):
        log.calls.clear()
        t = time.perf_counter()
        engine.step()
        sync()
        times.append(time.perf_counter() - t)
        if graphs:
            log.calls[:] = list(step_calls or [])
        recorded.append(list(log.calls))
        priced.append(log.priced_s(link, tp))
    engine.close()
    step_ms, coll_ms = statistics.median(times) * 1e3, statistics.median(priced) * 1e3
    seen = EmulatedExpertParallelMoE.pairs_seen
    middle = recorded[len(recorded) // 2]
    return {"batch": batch, "cuda_graphs": graphs, "step_ms_one_device": round(step_ms, 3),
            "collectives_ms_priced": round(coll_ms, 3), "step_calls": middle,
            "collectives_per_step": len(middle), "projected_itl_ms": round(step_ms + coll_ms, 3),
            "projected_tokens_per_s": round(batch / (step_ms + coll_ms) * 1e3, 1),
            "rank0_pairs_per_layer": round(sum(a for a, _ in seen) / len(seen), 2) if seen else None,
            "most_loaded_pairs_per_layer": round(sum(b for _, b in seen) / len(seen), 2) if seen else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="v4.1-flash")
    ap.add_argument("--override", default="{}", help="JSON of config fields to replace (CPU checks)")
    ap.add_argument("--tp", type=int, default=8, help="the split emulated: TP = EP = this many ranks")
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--load", choices=("max", "rank0"), default="max",
                    help="the MoE runs the most loaded rank's pair count (default) or rank 0's own")
    ap.add_argument("--graphs", action="store_true",
                    help="also time each batch replayed from CUDA graphs (the MoE block's own forward, rank 0's "
                         "pairs: what TP with graphs would run; cuda only)")
    ap.add_argument("--alpha-us", type=float, default=10.0, help="latency of one collective (assumption)")
    ap.add_argument("--link-GBps", type=float, default=350.0, help="NVLink bandwidth per GPU (assumption)")
    ap.add_argument("--json")
    args = ap.parse_args()
    device = torch.device(args.device)
    cfg = preset(args.preset).replace(**json.loads(args.override))
    link = LinkModel(args.alpha_us * 1e-6, args.link_GBps * 1e9)
    if args.graphs and device.type != "cuda":
        raise SystemExit("--graphs needs --device cuda")
    if args.graphs:  # both rows of a batch run the block's own forward, so they differ only by the graphs
        args.load = "rank0"
        EmulatedExpertParallelMoE.real_forward = True
    EmulatedExpertParallelMoE.most_loaded = args.load == "max"
    log = CallLog()
    t = time.perf_counter()
    model = build_rank0(cfg, args.tp, device, getattr(torch, args.dtype), log, seed=0)
    made_s = time.perf_counter() - t
    rows = []
    for b in args.batches.split(","):
        rows.append(run_batch(model, int(b), args.prompt, args.steps, device, args.dtype, log, link, args.tp))
        if args.graphs:
            rows.append(run_batch(model, int(b), args.prompt, args.steps, device, args.dtype, log, link, args.tp,
                                  graphs=True, step_calls=rows[-1]["step_calls"]))
    for r in rows:  # the call lists served the graph rows' pricing; the JSON keeps their count
        r.pop("step_calls")
    out = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "torch": torch.__version__,
           "command": "python3 -P benchmarks/rank0_emulation.py " + shlex.join(sys.argv[1:]),
           "preset": args.preset, "split": f"TP {args.tp} + EP {args.tp}, rank 0 emulated on one device",
           "link_model": {"alpha_us": args.alpha_us, "GBps": args.link_GBps, "basis": "assumption, not measured"},
           "moe_load": args.load, "model_create_s": round(made_s, 1), "rows": rows,
           "sglang_v4_flash_ms_per_token_batch1": SGLANG_V4_FLASH_MS}
    print(f"rank 0 of TP {args.tp} + EP {args.tp} ({args.preset}) on {out['device']}; made in {made_s:.1f} s; "
          f"link model {args.alpha_us:g} us + bytes / {args.link_GBps:g} GB/s")
    print(f"{'B':>4} {'graphs':>6} {'step ms':>9} {'coll ms':>8} {'calls':>6} {'ITL ms':>8} {'tok/s':>8} "
          f"{'pairs r0/max':>13}")
    for r in rows:
        print(f"{r['batch']:>4} {str(r['cuda_graphs']):>6} {r['step_ms_one_device']:>9.2f} "
              f"{r['collectives_ms_priced']:>8.2f} "
              f"{r['collectives_per_step']:>6} {r['projected_itl_ms']:>8.2f} {r['projected_tokens_per_s']:>8.1f} "
              + (f"{r['rank0_pairs_per_layer']:>6.1f}/{r['most_loaded_pairs_per_layer']:<6.1f}"
                 if r["rank0_pairs_per_layer"] is not None else f"{'-':>6}"))
    print("SGLang V4-Flash, batch 1: " + ", ".join(f"{k} {v} ms" for k, v in SGLANG_V4_FLASH_MS.items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
