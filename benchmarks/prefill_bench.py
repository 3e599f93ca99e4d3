"""Prefill of one long prompt: CED (20 encoder layers + a 128-token decoder replay) vs a full 40-layer prefill.

Same engine, same kernels, same chunking, one run:

    ced   = time to the first token of one ``--prompt``-token request (encoder over every token, chunk by chunk;
            layer 20's entries projected for every token; the decoder replays the last 128 tokens)
    full  = the same with every chunk's encoder outputs also run through the 20 decoder layers as they are
            produced (what a model without CED does), over the entries CED wrote; then the same replay
            (128 rows: < 1% of the prompt at 16K tokens, left in rather than estimated away)
    ratio = full time / ced time (target >= 1.8)

and the prefill's arithmetic rate: FLOPs = 2 x the multiply-adds of every linear a token passes through (the
routed experts it was sent to: top-k of them, the shared expert, attention projections, compressor, indexer,
Engram, head once) over the CED time, against a bf16 GEMM (8192^3, torch.matmul) measured in the same run. The
attention core (window + top-k entries per head) is left out of the count (a lower bound on the rate).

Usage: python3 -P benchmarks/prefill_bench.py [--preset flash-16e] [--prompt 16384] [--chunk 4096] [--json OUT]
(flashtier importable, TRITON_INTERPRET=0; on the CPU with --preset tiny as a check.)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from flashtier.engine.config import EngineConfig
from flashtier.engine.engine import Engine
from flashtier.engine.model import paged_forward
from flashtier.engine.model.moe import MoE
from flashtier.engine.sample.params import SamplingParams
from flashtier.engine.runner.step_metadata import RowSpan, build_step_rows
from flashtier.kvstore.config import KVStoreConfig

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _step_floor import make_model, sync  # noqa: E402


def gemm_rate(device: torch.device) -> float:
    """bf16 FLOP/s of an 8192^3 matmul on CUDA (1024^3 fp32 on the CPU), best of a few."""
    n, dt = (8192, torch.bfloat16) if device.type == "cuda" else (1024, torch.float32)
    a, b = torch.randn(n, n, device=device, dtype=dt), torch.randn(n, n, device=device, dtype=dt)
    best = float("inf")
    for _ in range(6):
        sync(device)
        t = time.perf_counter()
        a @ b
        sync(device)
        best = min(best, time.perf_counter() - t)
    return 2 * n**3 / best


def linear_macs_per_token(model) -> int:
    """Multiply-adds of the matrices one prompt token passes through in every layer: each 2-D weight as stored
    (float ``*.weight``, FP8 ``*.weight_q``, mHC ``*_fn``), Engram tables excluded (a lookup), the routed experts
    as top-k experts' w1 / w3 / w2 plus the shared expert. The head runs for the last token only (left out)."""
    cfg, macs = model.cfg, 0
    for block in model.layers:
        tensors = list(block.named_parameters()) + list(block.named_buffers())
        for name, t in tensors:
            dense = name.endswith(("weight", "weight_q", "_fn")) and "embed" not in name and "experts" not in name
            if t.dim() == 2 and dense:
                macs += t.shape[0] * t.shape[1]
        if isinstance(block.ffn, MoE):
            d, i = cfg.hidden_size, cfg.moe_intermediate_size
            macs += 3 * d * i * (cfg.num_experts_per_tok + cfg.n_shared_experts)
    return macs


def full_mode(engine: Engine) -> None:
    """Make the engine's batched runner also run the decoder over each encoder chunk (the full prefill)."""
    paged = engine.runner.paged
    real = paged_forward.encode_rows

    def encode_then_decode(model, states, rows, views, ids):
        x, pre = real(model, states, rows, views, ids)
        spans = [RowSpan(kv, len(kv.tokens) - n, len(kv.tokens), kv.dec_start)
                 for kv, n in zip(states, _lengths(rows, len(states)))]
        dec = build_step_rows(spans, paged.window, paged.ngram, model.device)
        paged_forward.decode_rows(model, dec, views, x, pre)
        return x, pre

    import flashtier.engine.runner.paged_runner as pr

    pr.encode_rows = encode_then_decode


def _lengths(rows, b: int) -> list[int]:
    last = rows.last_rows.tolist()
    return [last[0] + 1] + [last[i] - last[i - 1] for i in range(1, b)]


def ttft(model, prompt: list[int], chunk: int, full: bool, device: torch.device) -> float:
    ecfg = EngineConfig(device=device.type, dtype="bfloat16" if device.type == "cuda" else "float32",
                        forward="batched", max_num_seqs=1, max_num_batched_tokens=chunk,
                        max_model_len=len(prompt) + 64)
    engine = Engine(model, ecfg, KVStoreConfig(block_size=64, num_blocks=len(prompt) // 64 + 16))
    import flashtier.engine.runner.paged_runner as pr

    saved = pr.encode_rows
    try:
        if full:
            full_mode(engine)
        engine.add_request("r", prompt, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
        sync(device)
        t = time.perf_counter()
        while engine.has_unfinished():
            engine.step()
        sync(device)
        return time.perf_counter() - t
    finally:
        pr.encode_rows = saved


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="flash-16e")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--prompt", type=int, default=16384)
    ap.add_argument("--chunk", type=int, default=4096)
    ap.add_argument("--json")
    args = ap.parse_args()
    device = torch.device(args.device)
    peak = gemm_rate(device)
    model = make_model(args.preset, device)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, model.cfg.vocab_size - 1, (args.prompt,), generator=g).tolist()
    ttft(model, prompt[: min(len(prompt), 2 * args.chunk)], args.chunk, False, device)  # compile every shape
    ttft(model, prompt[: min(len(prompt), 2 * args.chunk)], args.chunk, True, device)
    ced = ttft(model, prompt, args.chunk, False, device)
    print(f"ced {ced:.2f} s", flush=True)
    full = ttft(model, prompt, args.chunk, True, device)
    print(f"full {full:.2f} s", flush=True)
    flops = 2 * linear_macs_per_token(model) * args.prompt
    out = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "torch": torch.__version__,
           "command": "python3 -P benchmarks/prefill_bench.py " + " ".join(sys.argv[1:]), "preset": args.preset,
           "prompt": args.prompt, "chunk": args.chunk, "ced_s": round(ced, 3), "full_s": round(full, 3),
           "ced_tok_s": round(args.prompt / ced, 1), "full_tok_s": round(args.prompt / full, 1),
           "full_over_ced": round(full / ced, 3), "linear_flops": flops, "gemm_peak_tflops": round(peak / 1e12, 1),
           "ced_tflops": round(flops / ced / 1e12, 2), "ced_over_peak": round(flops / ced / peak, 4)}
    print(json.dumps(out, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
