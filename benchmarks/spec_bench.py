"""Decode throughput with DSpark speculative decoding: the goodput controller against speculation off and a
fixed draft length, per drafter acceptance rate and batch size, same model, same prompts.

An oracle drafter (``OracleDrafter``, benchmark code only: it plugs in as the engine's ``Drafter``) replays the
plain run's own greedy continuation: the real drafter still runs (its cost is kept), then each of its drafts is
replaced by the right token with probability ``accept`` (the first miss and every draft after it wrong), so
``accept`` is the per-draft acceptance of a trained drafter (0: never accepted, 1: always).

For each batch size B and acceptance a, three engines run the same B greedy requests:

    off         --speculative off: one token per sequence and step (CUDA graphs on a GPU)
    fixed       --speculative DEPTH --no-speculative-adaptive: DEPTH drafts verified in every step
    controller  --speculative DEPTH (the goodput controller, engine/spec/controller.py)

Each engine first runs an untimed warm-up batch (B requests of ``--warm-tokens``: kernels compiled, graphs
captured, the controller's cold start for this bucket done), then the timed batch (B requests of ``--tokens``;
``--fixed-tokens`` for the slow fixed rows). Timing starts once every request has its first token (prefill
excluded). Every row's greedy tokens are compared with the off run's (exact in float64; on CUDA the engine is
not batch-invariant in fp32/bf16, so mismatching requests are counted, not failed). Printed: tok/s of each
engine, their ratios to off, the controller's steps by draft length in the timed batch.

    python3 -P benchmarks/spec_bench.py --device cuda --preset flash-16e --json OUT.json     (< 5 min, H100)
    python3 -P benchmarks/spec_bench.py --device cpu --preset tiny --json OUT.json           (seconds)
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time

import torch

from flashtier.engine.config import EngineConfig
from flashtier.engine.core.request import Request, Sequence
from flashtier.engine.engine import Engine
from flashtier.engine.model.config import preset
from flashtier.engine.sample.params import SamplingParams
from flashtier.engine.spec.drafter import Drafter
from flashtier.kvstore.config import KVStoreConfig

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}


class OracleDrafter(Drafter):
    """The real drafter's work, then its drafts replaced by the recorded greedy continuation, each right with
    probability ``accept`` until the first wrong one (a seeded RNG: the same run twice drafts the same)."""

    def __init__(self, model, depth: int, want: dict[str, list[int]], accept: float, seed: int = 0,
                 graphs=None):
        """``graphs``: the engine's drafter graphs (its real proposal replays them, as the engine's own would)."""
        super().__init__(model, depth, graphs)
        self.want, self.accept, self.rng = want, accept, random.Random(seed)

    def propose(self, live: list[tuple[Request, Sequence]], n: int) -> None:
        super().propose(live, n)
        vocab = self.model.cfg.vocab_size
        for req, seq in live:
            cont, done = self.want[req.request_id], len(seq.output)
            drafts, right = list(seq.spec.drafts), True
            for k in range(len(drafts)):
                right = right and self.rng.random() < self.accept and done + k < len(cont)
                drafts[k] = cont[done + k] if right else (cont[done + k] + 1) % vocab if done + k < len(cont) else 3
            seq.spec.drafts, seq.spec.q, seq.spec.confidence = tuple(drafts), None, None


def build(args) -> torch.nn.Module:
    dtype = _DTYPES[args.dtype]
    if args.device == "cuda":
        from flashtier.engine.model.init import random_model_on_device
        from flashtier.engine.model.moe_convert import convert_experts_
        from flashtier.engine.model.placement import quantize_linears_

        model = random_model_on_device(preset(args.preset), "cuda", dtype=dtype, with_dspark=True)
        quantize_linears_(model, "cuda")
        convert_experts_(model, "cuda")
        return model
    from flashtier.engine.model.init import random_model

    return random_model(preset(args.preset), seed=0, dtype=dtype, with_dspark=True)


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize()


def prompts(args, batch: int, tag: str, seed: int) -> list[tuple[str, list[int]]]:
    g = torch.Generator().manual_seed(seed)
    vocab = preset(args.preset).vocab_size
    return [(f"{tag}{i}", torch.randint(3, vocab - 1, (args.prompt,), generator=g).tolist()) for i in range(batch)]


def run_batch(eng: Engine, reqs, tokens: int) -> tuple[dict[str, list[int]], float, int]:
    """(tokens per request, decode seconds, decoded tokens): the clock starts once every request has a token."""
    dev = eng.model.device
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    for rid, prompt in reqs:
        eng.add_request(rid, prompt, params)
    out: dict[str, list[int]] = {}
    start = base = None
    while eng.has_unfinished():
        for o in eng.step():
            out.setdefault(o.request_id, []).extend(t for c in o.choices for t in c.token_ids)
        if start is None and len(out) == len(reqs) and all(out.values()):
            _sync(dev)
            start, base = time.perf_counter(), sum(map(len, out.values()))
    _sync(dev)
    return out, time.perf_counter() - start, sum(map(len, out.values())) - base


def engine_for(model, args, batch: int, mode: str, want=None, accept=None) -> Engine:
    depth = 0 if mode == "off" else args.depth
    cfg = EngineConfig(max_num_batched_tokens=max(512, batch * args.prompt), max_num_seqs=max(batch, 1),
                       dtype=args.dtype, device=args.device, speculative_tokens=depth,
                       speculative_min_confidence=0.0, speculative_adaptive=mode == "controller", forward="batched")
    eng = Engine(model, cfg, KVStoreConfig(block_size=64, num_blocks=args.blocks))
    if depth:  # the engine's draft graphs kept: the real drafter's cost is the captured one
        eng.drafter = OracleDrafter(model, depth, want, accept, graphs=eng.drafter.graphs)
    return eng


def row(model, args, batch: int, mode: str, want=None, accept=None) -> tuple[dict, dict[str, list[int]]]:
    eng = engine_for(model, args, batch, mode, want, accept)
    tokens = args.fixed_tokens if mode == "fixed" else args.tokens
    warm, _, _ = run_batch(eng, prompts(args, batch, "w", 2), args.warm_tokens if mode != "fixed" else 4)
    before = list(eng.spec_control.steps_by_length) if eng.spec_control else []
    out, seconds, decoded = run_batch(eng, prompts(args, batch, "t", 1), tokens)
    s = eng.stats()
    r = {"batch": batch, "mode": mode, "accept": accept, "tokens": tokens, "decode_s": round(seconds, 3),
         "tokens_per_s": round(decoded / seconds, 2),
         "mean_accepted": round(s.spec_accepted_tokens / s.spec_drafts, 3) if s.spec_drafts else 0.0}
    if eng.spec_control is not None:
        r["steps_by_draft_length"] = [a - b for a, b in zip(eng.spec_control.steps_by_length, before)]
    paged = eng.runner.paged
    if paged is not None and paged.graphs is not None:  # steps and proposals replayed (warm batch included)
        r["graph_steps"] = paged.graphs.runs
        r["graph_captures"] = paged.graphs.captures
        if eng.drafter is not None and eng.drafter.graphs is not None:
            r["draft_graph_runs"] = eng.drafter.graphs.runs
    return r, {**warm, **out}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="flash-16e")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", choices=sorted(_DTYPES), help="default: bfloat16 on cuda, float32 on cpu")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--accepts", default="0,0.5,0.8,1.0")
    ap.add_argument("--prompt", type=int, help="prompt tokens; default 64 on cuda, 8 on cpu")
    ap.add_argument("--tokens", type=int, help="timed tokens per request (off, controller); default 256 on "
                    "cuda, 48 on cpu")
    ap.add_argument("--fixed-tokens", type=int, help="timed tokens of the fixed rows; default 32 on cuda, 24 on cpu")
    ap.add_argument("--warm-tokens", type=int, default=24, help="tokens of the untimed warm-up batch")
    ap.add_argument("--depth", type=int, default=3)
    ap.add_argument("--blocks", type=int, default=1024)
    ap.add_argument("--json")
    args = ap.parse_args()
    cuda = args.device == "cuda"
    args.dtype = args.dtype or ("bfloat16" if cuda else "float32")
    args.prompt = args.prompt or (64 if cuda else 8)
    args.tokens = args.tokens or (256 if cuda else 48)
    args.fixed_tokens = args.fixed_tokens or (32 if cuda else 24)
    torch.manual_seed(0)
    t = time.perf_counter()
    model = build(args)
    print(f"model made in {time.perf_counter() - t:.1f} s", flush=True)
    rows, table = [], []
    for b in map(int, args.batches.split(",")):
        plain, want = row(model, args, b, "off")
        rows.append(plain)
        print(json.dumps(plain), flush=True)
        for accept in map(float, args.accepts.split(",")):
            got = {}
            for mode in ("fixed", "controller"):
                r, out = row(model, args, b, mode, want, accept)
                r["mismatched_requests"] = sum(out[k] != want[k][: len(out[k])] for k in out)
                r["vs_off"] = round(r["tokens_per_s"] / plain["tokens_per_s"], 3)
                if args.dtype == "float64" and r["mismatched_requests"]:
                    raise SystemExit(f"{mode} at accept {accept}: greedy tokens differ from the off run")
                rows.append(r)
                got[mode] = r
                print(json.dumps(r), flush=True)
            table.append((b, accept, plain["tokens_per_s"], got["fixed"], got["controller"]))
    print(f"\n{'batch':>5} {'accept':>6} {'off tok/s':>10} {'fixed tok/s':>12} {'ctrl tok/s':>11} "
          f"{'fixed/off':>9} {'ctrl/off':>8} {'ctrl/fixed':>10}  ctrl steps by draft length")
    for b, a, off, fixed, ctrl in table:
        print(f"{b:>5} {a:>6.2f} {off:>10.2f} {fixed['tokens_per_s']:>12.2f} {ctrl['tokens_per_s']:>11.2f} "
              f"{fixed['vs_off']:>9.3f} {ctrl['vs_off']:>8.3f} "
              f"{ctrl['tokens_per_s'] / fixed['tokens_per_s']:>10.3f}  {ctrl['steps_by_draft_length']}")
    if args.json:
        info = {"device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
                "command": " ".join(["python3", "-P", *sys.argv]), "rows": rows}
        with open(args.json, "w") as f:
            json.dump(info, f, indent=1)


if __name__ == "__main__":
    main()
