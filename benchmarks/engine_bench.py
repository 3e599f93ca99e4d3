"""Engine throughput vs the reference incremental path, measured in one process.

Prefill tokens/s and decode tokens/s at batch 1 / 8 / 32, for the paged, batched engine and for the
contiguous incremental path (``IncrementalModel``, one sequence at a time) on the same model and
prompts. Prints a table of ratios and writes JSON (``--out``). ``--forwards`` runs the engine with each of
``EngineConfig.forward``'s values given (rows say which): "auto" is the batched forward on every device,
"per-sequence" the plain-torch per-sequence attention.

    python benchmarks/engine_bench.py --preset tiny --out docs/perf/engine_tiny_cpu.json
    python benchmarks/engine_bench.py --preset flash-16e --device cuda --dtype bfloat16 ...   (GPU host)
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time

import torch

from flashtier.engine.config import EngineConfig
from flashtier.engine.engine import Engine
from flashtier.engine.model.config import preset
from flashtier.engine.model.incremental import IncrementalModel
from flashtier.engine.model.init import random_model
from flashtier.engine.sample.params import SamplingParams
from flashtier.kvstore.config import KVStoreConfig


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize()


def engine_run(model, prompts, max_tokens, budget, blocks, forward: str = "auto") -> float:
    eng = Engine(model, EngineConfig(max_num_batched_tokens=budget, max_num_seqs=64, forward=forward),
                 KVStoreConfig(block_size=64, num_blocks=blocks))
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for i, p in enumerate(prompts):
        eng.add_request(f"b{i}", p, params)
    _sync(model.device)
    t = time.perf_counter()
    while eng.has_unfinished():
        eng.step()
    _sync(model.device)
    return time.perf_counter() - t


def reference_run(model, prompts, max_tokens) -> float:
    runner = IncrementalModel(model)
    _sync(model.device)
    t = time.perf_counter()
    for p in prompts:
        state = runner.new_state()
        logits = runner.prefill(state, p)
        for _ in range(max_tokens - 1):
            logits = runner.decode(state, int(torch.argmax(logits)))
    _sync(model.device)
    return time.perf_counter() - t


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--decode-tokens", type=int, default=16)
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--forwards", default="auto", help="comma-separated EngineConfig.forward values to run")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    dev = torch.device(args.device)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    model = random_model(preset(args.preset), seed=0, dtype=dtype, with_dspark=False).to(dev)
    model.token_map = model.token_map.to(dev)
    g = torch.Generator().manual_seed(0)
    rows = []
    forwards = args.forwards.split(",")
    for b in [int(x) for x in args.batches.split(",")]:
        prompts = [torch.randint(3, 128000, (args.prompt_len,), generator=g).tolist() for _ in range(b)]
        blocks = b * (-(-(args.prompt_len + args.decode_tokens) // 64) + 1) + 2
        budget = max(512, args.prompt_len)
        r_pre = reference_run(model, prompts, 1)
        r_all = reference_run(model, prompts, 1 + args.decode_tokens)
        for forward in forwards:
            engine_run(model, prompts[:1], 2, budget, blocks, forward)  # warm-up
            e_pre = engine_run(model, prompts, 1, budget, blocks, forward)
            e_all = engine_run(model, prompts, 1 + args.decode_tokens, budget, blocks, forward)
            pre_tok, dec_tok = b * args.prompt_len, b * args.decode_tokens
            e_dec, r_dec = max(e_all - e_pre, 1e-9), max(r_all - r_pre, 1e-9)
            rows.append({
                "batch": b, "forward": forward,
                "engine_prefill_tok_s": pre_tok / e_pre, "reference_prefill_tok_s": pre_tok / r_pre,
                "prefill_ratio": r_pre / e_pre,
                "engine_decode_tok_s": dec_tok / e_dec, "reference_decode_tok_s": dec_tok / r_dec,
                "decode_ratio": r_dec / e_dec,
            })
    print(f"{'batch':>5} {'forward':>12} {'prefill tok/s':>14} {'vs ref':>7} {'decode tok/s':>13} {'vs ref':>7}")
    for r in rows:
        print(f"{r['batch']:>5} {r['forward']:>12} {r['engine_prefill_tok_s']:>14.1f} {r['prefill_ratio']:>6.2f}x "
              f"{r['engine_decode_tok_s']:>13.1f} {r['decode_ratio']:>6.2f}x")
    if args.out:
        result = {
            "command": "python benchmarks/engine_bench.py " + " ".join(argv if argv is not None else sys.argv[1:]),
            "preset": args.preset, "device": str(dev), "dtype": args.dtype,
            "host": platform.processor() or platform.machine(), "torch": torch.__version__,
            "threads": torch.get_num_threads(), "prompt_len": args.prompt_len,
            "decode_tokens": args.decode_tokens, "rows": rows,
        }
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
