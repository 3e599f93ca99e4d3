"""One MoE layer on one CUDA GPU: time per layer at 1 / 8 / 64 tokens, bytes touched vs a device copy.

The layer is flash-16e's (5120 wide, 16 routed experts top-6 in MXFP4, one 2304-wide shared expert in
FP8, gate fp32), built on the GPU with random weights (``ExpertWeights.random_``). Each row times
``MoE.forward`` (routing + experts + combine) and each of its launches:

    touched  = routed experts the batch selects x their MXFP4 bytes + the shared expert's FP8 bytes
               + the gate (fp32) + x and y                                 (what the layer must read/write)
    floor    = touched / copy rate;  copy rate = bytes read + written by a 2 GiB device-to-device copy,
               measured in this run
    eff      = touched / graph time: the layer's effective bandwidth (ratio = graph time / floor)

``eager`` is triton.testing.do_bench of the Python call (L2 cleared before each run; includes the host
launch overhead of its ~8 launches); ``graph`` replays the layer captured in a CUDA graph (no host in the
loop: what the engine will run). Each row is also checked against the reference (per-row relative RMS) and
for batch invariance (a token alone == the same token in the batch). ``--sweep`` times the experts under
each launch shape and K split in SWEEP (each checked the same way) and each projection's launches at 1 token.

Usage: python3 -P benchmarks/moe_bench.py [--preset flash-16e] [--sweep [--sweep-range START:END]]
       [--out docs/perf/moe.json]
(flashtier importable, TRITON_INTERPRET=0)
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys

import torch
import triton
from triton.testing import do_bench

from flashtier.engine.model.config import preset
from flashtier.engine.model.expert_weights import ExpertWeights
from flashtier.engine.model.moe import MoE
from flashtier.kernels.moe.combine_kernel import moe_combine_triton
from flashtier.kernels.moe.grouped_gemm_kernel import DEFAULT_CONFIG, MoEGemmConfig, launch_moe_gemm
from flashtier.kernels.moe.align import moe_align
from flashtier.kernels.moe.grouped_gemm import moe_grouped_ffn
from flashtier.kernels.quant.fp8 import fp8_qdq

DEVICE, BATCHES = "cuda", (1, 8, 64)
TOL = 5e-3  # worst row's relative RMS vs the reference (tests/kernels/test_moe_grouped_gemm.py)
SWEEP = [  # (block_m, block_n, block_k, num_warps, num_stages, split_k, split_k_w2 or None: the same)
    # the shipped tiles under each K split
    (16, 32, 64, 4, 4, 1, None), (16, 32, 64, 4, 4, 2, None), (16, 32, 64, 4, 4, 4, None),
    (16, 32, 64, 4, 4, 8, None), (16, 32, 64, 4, 4, 16, None),
    # w2 has half the K steps of w1 + w3 and twice the N tiles: it may want fewer splits
    (16, 32, 64, 4, 4, 4, 1), (16, 32, 64, 4, 4, 8, 1), (16, 32, 64, 4, 4, 8, 2), (16, 32, 64, 4, 4, 16, 4),
    # wider or narrower programs under a split
    (16, 64, 64, 4, 4, 4, None), (16, 64, 64, 4, 4, 8, None), (16, 64, 64, 8, 4, 8, None),
    (16, 32, 64, 8, 4, 4, None), (16, 32, 64, 8, 4, 8, None), (16, 32, 64, 2, 4, 8, None),
    (16, 32, 128, 4, 3, 4, None), (16, 32, 64, 4, 2, 8, None),
    # the previous sweep's best single-pass shapes, for comparison
    (16, 64, 64, 8, 4, 1, None), (16, 64, 64, 4, 4, 1, None), (32, 64, 64, 8, 4, 1, None),
]


def build_layer(preset_name: str, seed: int = 0) -> MoE:
    cfg = preset(preset_name)
    d, i, e = cfg.hidden_size, cfg.moe_intermediate_size, cfg.n_routed_experts
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    with torch.device("meta"):
        moe = MoE(cfg, e, cfg.num_experts_per_tok, torch.float32)
    moe.gate.to_empty(device=DEVICE)
    moe.gate.weight.data = torch.randn(e, d, generator=g, device=DEVICE) / d**0.5
    moe.gate.bias.data = 0.1 * torch.randn(e, generator=g, device=DEVICE)
    moe.experts = ExpertWeights(e, d, i, i * cfg.n_shared_experts, DEVICE).random_(seed)
    moe.shared_experts = None
    return moe


def copy_rate() -> float:
    x = torch.randint(0, 256, (2 << 30,), dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    ms = do_bench(lambda: y.copy_(x), warmup=10, rep=100, return_mode="median")
    return 2 * x.numel() / (ms * 1e-3)


def graph_us(fn, reps: int = 200) -> float:
    """Median µs of replaying ``fn`` captured in a CUDA graph (fails if ``fn`` syncs with the host)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return 1e3 * do_bench(graph.replay, warmup=10, rep=reps, return_mode="median")


def stage_us(moe: MoE, x: torch.Tensor, cfg: MoEGemmConfig = DEFAULT_CONFIG,
             only: tuple[str, ...] | None = None) -> dict[str, float]:
    """Median µs of each launch of the layer (a split projection: its GEMM and reduce), in isolation
    (CUDA-graph replay); ``only`` picks some of them."""
    ew = moe.experts
    n, d = x.shape
    idx, w = moe.route(x)
    k = idx.shape[1]
    xq = fp8_qdq(x)
    al = moe_align(idx, ew.n_experts, cfg.block_m)
    n_tiles = al.block_expert.numel() + triton.cdiv(n, cfg.block_m)
    act = torch.empty((n_tiles * cfg.block_m, max(ew.inter, ew.shared_inter)), dtype=torch.bfloat16, device=DEVICE)
    out = torch.empty((n * k + n, d), device=DEVICE)
    r, s = ew.routed(), ew.shared()
    common = dict(ids=al.sorted_ids, block_expert=al.block_expert, n_tok=n, top_k=k, config=cfg)
    stages = {
        "route": lambda: moe.route(x),
        "x_quant": lambda: fp8_qdq(x),
        "align": lambda: moe_align(idx, ew.n_experts, cfg.block_m),
        "w13+shared": lambda: launch_moe_gemm(xq, act, (r.w13_codes, r.w13_scales), (s.w13_codes, s.w13_scales),
                                              gated=True, k_r=d, k_s=d, n_r=ew.inter, n_s=ew.shared_inter,
                                              route_w=w.view(-1), limit=moe.limit, **common),
        "w2+shared": lambda: launch_moe_gemm(act, out, (r.w2_codes, r.w2_scales), (s.w2_codes, s.w2_scales),
                                             gated=False, k_r=ew.inter, k_s=ew.shared_inter, n_r=d, n_s=d, **common),
        "combine": lambda: moe_combine_triton(out[: n * k], idx, out[n * k :]),
    }
    return {name: round(graph_us(fn, reps=100), 1) for name, fn in stages.items() if only is None or name in only}


def touched_bytes(moe: MoE, x: torch.Tensor) -> tuple[int, int]:
    """(bytes the layer must move for ``x``, routed experts selected)."""
    ew = moe.experts
    n_used = int(torch.unique(moe.route(x)[0]).numel())
    shared = sum(t.numel() for t in ew.shared())
    gate = moe.gate.weight.numel() * moe.gate.weight.element_size()
    return n_used * ew.expert_nbytes() + shared + gate + 2 * x.numel() * 4, n_used


def row_err(moe: MoE, x: torch.Tensor) -> tuple[float, bool]:
    with torch.no_grad():
        out = moe(x)
        moe.experts.impl = "reference"
        ref = moe(x)
        moe.experts.impl = "auto"
        err = float(((out.double() - ref.double()).norm(dim=1) / ref.double().norm(dim=1)).max())
        invariant = torch.equal(moe(x[-1:])[0], out[-1])
    return err, invariant


def sweep(moe: MoE, rate: float, configs: list[tuple] = SWEEP) -> list[dict]:
    """Time the experts (route excluded) under each SWEEP config; each is checked against the reference and for
    batch invariance (tokens 0 and 63 alone == in the batch of 64, bit for bit) first."""
    ew, results = moe.experts, []
    gen = torch.Generator(device=DEVICE).manual_seed(2)
    inputs = {n: torch.randn(n, ew.dim, generator=gen, device=DEVICE) for n in BATCHES}
    routes = {n: moe.route(x) for n, x in inputs.items()}
    refs = {n: moe_grouped_ffn(x, *routes[n], ew.routed(), ew.shared(), moe.limit, impl="reference")
            for n, x in inputs.items()}
    big = max(BATCHES)
    for bm, bn, bk, nw, ns, sk, sk2 in configs:
        cfg = MoEGemmConfig(bm, bn, bk, nw, ns, sk, sk2)
        run = {n: (lambda x=x, n=n: moe_grouped_ffn(x, *routes[n], ew.routed(), ew.shared(), moe.limit, config=cfg))
               for n, x in inputs.items()}
        err = max(float(((run[n]().double() - refs[n].double()).norm(dim=1) / refs[n].double().norm(dim=1)).max())
                  for n in inputs)
        x, (idx, w) = inputs[big], routes[big]
        whole = run[big]()
        invariant = all(torch.equal(moe_grouped_ffn(x[t : t + 1], idx[t : t + 1], w[t : t + 1], ew.routed(),
                                                    ew.shared(), moe.limit, config=cfg)[0], whole[t])
                        for t in (0, big - 1))
        us = {n: round(graph_us(run[n], reps=100), 1) for n in inputs}
        launches = stage_us(moe, inputs[1], cfg, only=("w13+shared", "w2+shared"))
        results.append(dict(config=cfg.__dict__, err=float(f"{err:.2e}"), us=us, batch_invariant=invariant,
                            stages_us_1_token=launches))
        times = " ".join(f"N{n}={t:7.1f}" for n, t in us.items())
        verdict = "ok " if err <= TOL and invariant else "BAD"
        split = f"{sk}" + (f"/{sk2}" if sk2 is not None else "")
        print(f"  m{bm:<3}n{bn:<3}k{bk:<4}w{nw:<3}s{ns} split {split:<5} err {err:.1e} inv {invariant!s:<5} {verdict} "
              f"{times}  (1 token: w13 {launches['w13+shared']:.1f}, w2 {launches['w2+shared']:.1f})", flush=True)
    return results


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="flash-16e")
    ap.add_argument("--out", default=None, help="write the rows as JSON (docs/perf/moe.json)")
    ap.add_argument("--sweep", action="store_true", help="also time the experts under each launch config")
    ap.add_argument("--sweep-range", default=":", metavar="START:END",
                    help="only SWEEP[START:END] (e.g. 0:10 then 10:, to fit a time limit per run)")
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    dev = f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}"
    rate = copy_rate()
    moe = build_layer(args.preset)
    ew = moe.experts
    print(f"{dev}; D2D copy {rate / 1e12:.2f} TB/s; {args.preset}: {ew}", flush=True)
    rows, bad = [], 0
    gen = torch.Generator(device=DEVICE).manual_seed(1)
    for n in BATCHES:
        x = torch.randn(n, ew.dim, generator=gen, device=DEVICE)
        with torch.no_grad():
            touched, n_used = touched_bytes(moe, x)
            eager = 1e3 * do_bench(lambda: moe(x), warmup=10, rep=200, return_mode="median")
            graph = graph_us(lambda: moe(x))
            stages = stage_us(moe, x)
        err, invariant = row_err(moe, x)
        bad += err > TOL or not invariant
        floor = touched / rate * 1e6
        rows.append(dict(tokens=n, experts_used=n_used, touched_MB=round(touched / 1e6, 2), floor_us=round(floor, 1),
                         eager_us=round(eager, 1), graph_us=round(graph, 1), ratio=round(graph / floor, 2),
                         eff_TBps=round(touched / (graph * 1e-6) / 1e12, 2), rel_err=float(f"{err:.2e}"),
                         batch_invariant=invariant, stages_us=stages))
    swept = []
    if args.sweep:
        print("\nsweep (experts only, CUDA-graph us per config and batch):", flush=True)
        with torch.no_grad():
            start, _, end = args.sweep_range.partition(":")
            swept = sweep(moe, rate, SWEEP[int(start or 0) : int(end) if end else None])
        bad += sum(not (r["err"] <= TOL and r["batch_invariant"]) for r in swept)
    print(f"\n{'tokens':>6} {'experts':>7} {'MB':>7} {'floor us':>8} {'graph us':>8} {'eager us':>8} {'ratio':>6} "
          f"{'TB/s':>5} {'rel err':>8} inv")
    for r in rows:
        print(f"{r['tokens']:>6} {r['experts_used']:>7} {r['touched_MB']:>7} {r['floor_us']:>8} {r['graph_us']:>8} "
              f"{r['eager_us']:>8} {r['ratio']:>6} {r['eff_TBps']:>5} {r['rel_err']:>8} {r['batch_invariant']}")
    for r in rows:
        print(f"  stages at {r['tokens']} tokens (us, each alone): {r['stages_us']}")
    if args.out:
        doc = dict(date=datetime.date.today().isoformat(), device=dev,
                   command="python3 -P benchmarks/moe_bench.py " + " ".join(sys.argv[1:]), preset=args.preset,
                   copy_TBps=round(rate / 1e12, 3), config=DEFAULT_CONFIG.__dict__,
                   meaning=("one MoE layer (route + routed MXFP4 experts + shared FP8 expert + combine); touched = "
                            "selected experts' bytes + shared expert + gate + x/y; floor = touched / copy rate "
                            "measured in the same run; graph_us = CUDA-graph replay median, eager_us = do_bench of "
                            "the Python call; ratio = graph_us / floor_us; rel_err = worst row vs the reference"),
                   rows=rows, sweep=swept)
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=1)
        print(f"wrote {args.out}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
