"""End-to-end decode tok/s of flashtier against HF transformers' ``DeepseekV4ForCausalLM`` on a matched geometry.

One process, one device, the same B random ``--prompt``-token prompts for both, tok/s = B / median decode step.
flashtier: the preset (flash-16e: random weights made on the GPU in the checkpoint formats) in an Engine set up as
gpu_step_bench.py does (batched forward, CUDA graphs), each ``Engine.step()`` timed whole. HF (built after flashtier
is freed): ``DeepseekV4Config(**hf_config_dict(...))`` random-initialised on the device in bf16, ``generate`` greedy
with ``use_cache=True``; a logits processor stamps each generated token, so the intervals after the first are the
decode steps (the mean by difference with a ``max_new_tokens=1`` call is kept too). HF's V4 has no V4.1 layer
kinds: ``--hf-layout ratio-matched`` maps ratio 0 to sliding, the encoder's 2 to CSA at rate 2, the decoder's 1 to
HCA at rate 1; ``v4-native`` takes V4-Flash's CSA m=4 / HCA m=128 alternation; ``DIFFERENCES`` names the rest.
A failed stage records its error and the run goes on; the JSON is rewritten after every stage.

GPU: python3 -P benchmarks/hf_compare_bench.py --batches 1,8 --json docs/perf/hf_compare.json
CPU: python3 -P benchmarks/hf_compare_bench.py --device cpu --tiny --batches 1,2 --prompt 24 --steps 3
"""

from __future__ import annotations

import argparse
import gc
import json
import shlex
import statistics
import sys
import time
import traceback
from importlib import metadata
from pathlib import Path

import torch

from flashtier.engine.config import EngineConfig
from flashtier.engine.engine import Engine
from flashtier.engine.model.config import ModelConfig, preset
from flashtier.engine.sample.params import SamplingParams
from flashtier.kvstore.config import KVStoreConfig

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the shared model maker (run as python3 -P)
from _step_floor import make_model  # noqa: E402

BLOCK, LAYOUTS = 64, ("ratio-matched", "v4-native")  # engine block size as gpu_step_bench.py; --hf-layout choices
DIFFERENCES = [  # V4 as HF transformers 5.17 builds it vs V4.1 (reference/model.md, engine/model/config.py)
    "CSA2 sharing: V4.1 makes global KV only at layers 2/8/14/20 and top-k only at 2/8/14/20/24/28/32/36, the rest "
    "reuse them; in HF V4 every compressed layer has its own compressor and every CSA layer its own indexer",
    "ratios: V4.1 encoder m=2 (no overlap or position bias), decoder m=1; V4 CSA m=4 (overlapping 2m windows, "
    "position bias), HCA m=128 (no indexer); ratio-matched runs CSA at m=2 and HCA at m=1 (dense over its entries)",
    "CED: V4.1's decoder KV is layer 20's ratio-1 compressor on the encoder output, shared by layers 20-39; a "
    "prompt runs only its last 128 tokens through the decoder; V4 has no encoder/decoder split",
    "indexer: V4.1 layer 20 keeps a candidate pool (top 2048 blocks of 8) for Reindex layers 24-36; index K = "
    "k_norm(wk(main latent)); V4 indexers score all entries, keys from their own compressor",
    "mHC: V4.1 is single-pass (a sub-layer's input collapse comes from the previous one; no hc_head); V4 is not",
    "V4 has a per-head q RMSNorm, 3 hash-routed MoE layers (mapped to 'moe' here), 1 MTP layer; V4.1 has no q norm, "
    "Engram tables before layers 1 and 14, a 3-stage DSpark drafter (not built here), a vision tower (unused)",
    "numerics: V4.1 QDQs window KV FP8 (ue8m0/32), main KV FP4 (e4m3/16), indexer q/k MXFP4; HF V4 is plain bf16",
    "weights: flashtier keeps linears FP8 (e8m0 per 32x32), routed experts MXFP4; HF bf16 (2-4x the bytes per step)",
    "KV: flashtier pages 890 B/token of global KV plus FP8 128-slot rings; HF's DynamicCache keeps bf16 windows and "
    "compressed entries, grown by torch.cat each step",
    "kernels: HF V4 is eager only (no FlashAttention/SDPA/flex: dense scores over window + all entries, -inf for "
    "unselected), op by op, no static cache or compile; flashtier: sparse MQA on the top-k, CUDA-graph replay",
    "widths: V4-Flash's own are hidden 4096, q_lora 1024, 64 indexer heads, 256 experts x 2048, rms eps 1e-6, 43 "
    "layers; the HF config here takes V4.1's (rms_norm_eps 1e-20 included)",
]


def hf_layer_types(cfg: ModelConfig, layout: str) -> tuple[list[str], dict[str, int]]:
    """HF ``layer_types`` and ``compress_rates`` for ``cfg``'s backbone. Raises ValueError on an unknown ``layout``
    or (ratio-matched) a ratio that is not 0, the decoder's 1 or one encoder ratio > 1."""
    n = cfg.num_hidden_layers
    if layout == "v4-native":  # V4-Flash: two sliding layers, then CSA m=4 / HCA m=128 alternating
        kinds = ["sliding_attention"] * min(n, 2) + [
            "heavily_compressed_attention" if i % 2 else "compressed_sparse_attention" for i in range(n - 2)]
        return kinds, {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128}
    if layout != "ratio-matched":
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    ratios = cfg.compress_ratios[:n]
    encoder = sorted({r for r in ratios if r > 1})
    if len(encoder) > 1:
        raise ValueError(f"cfg has encoder ratios {encoder}; HF V4 has one CSA rate, so one ratio > 1 at most")
    rates = {"compressed_sparse_attention": encoder[0] if encoder else 4, "heavily_compressed_attention": 1}
    names = {0: "sliding_attention", 1: "heavily_compressed_attention"}
    return [names.get(r, "compressed_sparse_attention") for r in ratios], rates


SAME = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "head_dim", "q_lora_rank",
        "o_groups", "o_lora_rank", "n_routed_experts", "n_shared_experts", "num_experts_per_tok",
        "moe_intermediate_size", "routed_scaling_factor", "swiglu_limit", "sliding_window", "index_n_heads",
        "index_head_dim", "index_topk", "hc_mult", "hc_sinkhorn_iters", "hc_eps", "rms_norm_eps",
        "max_position_embeddings", "rope_theta", "compress_rope_theta", "num_nextn_predict_layers",
        "bos_token_id", "eos_token_id", "pad_token_id")  # same name and meaning in ModelConfig and DeepseekV4Config


def hf_config_dict(cfg: ModelConfig, layout: str = "ratio-matched") -> dict:
    """``DeepseekV4Config`` keyword arguments matching ``cfg``'s geometry (pure Python; ValueError as above)."""
    layer_types, rates = hf_layer_types(cfg, layout)
    return {**{k: getattr(cfg, k) for k in SAME}, "num_key_value_heads": 1, "tie_word_embeddings": False,
            "partial_rotary_factor": cfg.qk_rope_head_dim / cfg.head_dim, "scoring_func": "sqrtsoftplus",
            "norm_topk_prob": True, "mlp_layer_types": ["moe"] * cfg.num_hidden_layers, "layer_types": layer_types,
            "compress_rates": rates,
            "rope_parameters": {"rope_type": "yarn", "factor": cfg.rope_factor, "beta_fast": cfg.beta_fast,
                                "beta_slow": cfg.beta_slow, "original_max_position_embeddings": cfg.original_seq_len}}


def prompts(batch: int, prompt: int, vocab: int) -> torch.Tensor:
    """[batch, prompt] token ids, seeded by ``batch`` (the same ids for both models)."""
    g = torch.Generator().manual_seed(batch)
    return torch.stack([torch.randint(3, vocab - 1, (prompt,), generator=g) for _ in range(batch)])


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def rates(batch: int, times: list[float]) -> dict:
    step_s = statistics.median(times)
    return {"step_ms": round(step_s * 1e3, 3), "tokens_per_s": round(batch / step_s, 1),
            "step_ms_all": [round(t * 1e3, 3) for t in times]}


def tensor_bytes(model) -> int:
    return sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])


def flashtier_decode(model, ids: torch.Tensor, steps: int, device: torch.device) -> dict:
    """Prefill the rows of ``ids`` in a fresh Engine (gpu_step_bench.py's set-up), then time ``steps`` steps."""
    batch, prompt = ids.shape
    blocks = batch * (-(-(prompt + steps + 8) // BLOCK) + 1) + 8
    cuda = device.type == "cuda"
    ecfg = EngineConfig(device=device.type, dtype="bfloat16" if cuda else "float32", forward="batched" if cuda
                        else "auto", max_num_seqs=batch, max_num_batched_tokens=4096, cuda_graphs=cuda)
    engine = Engine(model, ecfg, KVStoreConfig(block_size=BLOCK, num_blocks=blocks))
    params = SamplingParams(temperature=0, max_tokens=steps + 8, ignore_eos=True)
    for i, row in enumerate(ids.tolist()):
        engine.add_request(f"r{i}", row, params)
    t0 = time.perf_counter()
    while sum(1 for r in engine.requests.values() for s in r.seqs if s.output) < batch:
        engine.step()
    sync(device)
    prefill_s = time.perf_counter() - t0
    times = []
    for _ in range(steps + 1):  # the first (untimed) decode step captures the CUDA graph
        t = time.perf_counter()
        engine.step()
        sync(device)
        times.append(time.perf_counter() - t)
    return {**rates(batch, times[1:]), "prefill_s": round(prefill_s, 3)}


def hf_decode(model, ids: torch.Tensor, steps: int, device: torch.device) -> dict:
    """Greedy ``generate`` of ``steps + 1`` tokens with a synchronised timestamp per generated token."""
    from transformers.generation import LogitsProcessor, LogitsProcessorList

    stamps: list[float] = []

    class StepClock(LogitsProcessor):
        def __call__(self, input_ids, scores):
            sync(device)  # generate syncs every step anyway (its stopping check reads a flag on the host)
            stamps.append(time.perf_counter())
            return scores

    batch, ids = ids.shape[0], ids.to(device)
    kw = {"attention_mask": torch.ones_like(ids), "do_sample": False, "use_cache": True,
          "pad_token_id": model.config.pad_token_id}

    def gen(new: int, clock: bool = False):
        sync(device)
        t = time.perf_counter()
        procs = LogitsProcessorList([StepClock()] if clock else [])
        with torch.inference_mode():
            out = model.generate(ids, max_new_tokens=new, min_new_tokens=new, logits_processor=procs, **kw)
        sync(device)
        if out.shape[1] != ids.shape[1] + new:
            raise RuntimeError(f"generate returned {out.shape[1] - ids.shape[1]} new tokens, asked for {new}")
        return time.perf_counter() - t, t

    gen(2)  # warm-up
    prefill_s, _ = gen(1)
    total_s, start = gen(steps + 1, clock=True)
    mean_s = (total_s - prefill_s) / steps
    return {**rates(batch, [b - a for a, b in zip(stamps, stamps[1:])]),
            "prefill_s": round(prefill_s, 3), "prefill_stamp_s": round(stamps[0] - start, 3),
            "step_ms_mean_by_difference": round(mean_s * 1e3, 3),
            "tokens_per_s_by_difference": round(batch / mean_s, 1)}


def stage(out: dict, key: str, fn, *a):
    """Run ``fn(*a)`` and print its result; on failure append the error text to ``out["errors"]``, return None."""
    print(f"[{time.strftime('%H:%M:%S')}] {key} ...", flush=True)
    try:
        result = fn(*a)
        if isinstance(result, dict) and "tokens_per_s" in result:
            print(f"  {key}: { {k: v for k, v in result.items() if k != 'step_ms_all'} }", flush=True)
        return result
    except Exception as exc:  # noqa: BLE001 - one failed stage must not lose the others' results
        text = f"{type(exc).__name__}: {exc}"[:2000]
        out["errors"].append({"stage": key, "error": text, "trace": traceback.format_exc()[-3000:]})
        print(f"  FAILED {key}: {text}", flush=True)
        return None


def versions() -> dict:
    v = {"torch": torch.__version__, "cuda": torch.version.cuda}
    for pkg in ("transformers", "accelerate", "safetensors", "triton", "flashtier"):
        dist = next(iter(metadata.distributions(name=pkg)), None)
        v[pkg] = dist and dist.version
    return v


def build_hf(hf_kw: dict, dtype: torch.dtype, device: torch.device, budget: float, out: dict):
    """The HF model on ``device`` in ``dtype``, sized on the meta device first. Writes the HF config, sizes and
    timings into ``out``; over ``budget`` GB (or the free memory less 8 GB) sets ``out["hf_skipped"]``, returns None."""
    import transformers
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    out["versions"]["transformers"] = transformers.__version__
    config = DeepseekV4Config(**hf_kw)
    out["hf_config"] = json.loads(config.to_json_string(use_diff=False))
    with torch.device("meta"):
        nbytes = tensor_bytes(DeepseekV4ForCausalLM._from_config(config, dtype=dtype))
    free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else None
    out["hf_param_bytes"], out["device_free_bytes_before_hf"] = nbytes, free
    print(f"  HF parameters: {nbytes / 1e9:.2f} GB ({dtype}); device free: {free} B", flush=True)
    if nbytes > budget * 1e9 or (free is not None and nbytes > free - 8e9):
        out["hf_skipped"] = f"HF model needs {nbytes / 1e9:.1f} GB; budget {budget} GB, free {free} B (8 GB kept)"
        print(f"  SKIP HF: {out['hf_skipped']}", flush=True)
        return None
    t = time.perf_counter()
    with torch.device(device):
        model = DeepseekV4ForCausalLM._from_config(config, dtype=dtype).eval()
    sync(device)
    out["hf_create_s"] = round(time.perf_counter() - t, 1)
    out["hf_implementations"] = [model.config._attn_implementation, getattr(model.config, "_experts_implementation", 0)]
    return model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for flag, default in (("--preset", "flash-16e"), ("--device", "cuda"), ("--batches", "1,8"), ("--json", None)):
        ap.add_argument(flag, default=default)
    ap.add_argument("--tiny", action="store_true", help="the tiny preset (CPU check of the whole pipeline)")
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--hf-layout", choices=LAYOUTS, default="ratio-matched")
    ap.add_argument("--hf-budget-gb", type=float, default=120.0)
    ap.add_argument("--skip", choices=("none", "flashtier", "hf"), default="none")
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    if args.prompt < 2 or args.steps < 1 or min(batches) < 1:
        raise ValueError("--prompt must be >= 2, --steps and every --batches entry >= 1")
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    cfg = preset("tiny" if args.tiny else args.preset)
    out = {"device": torch.cuda.get_device_name(device) if cuda else "cpu", "versions": versions(),
           "command": shlex.join([sys.executable, *sys.argv]), "preset": cfg.name, "hf_layout": args.hf_layout,
           "batch_prompt_steps": [batches, args.prompt, args.steps], "flashtier_config": cfg.to_hf_dict(),
           "differences": DIFFERENCES, "rows": [{"batch": b} for b in batches], "errors": []}

    def save():
        if args.json:
            Path(args.json).write_text(json.dumps(out, indent=1, default=str))

    inputs = {b: prompts(b, args.prompt, cfg.vocab_size) for b in batches}
    if args.skip != "flashtier":
        t = time.perf_counter()
        model = stage(out, "flashtier model", make_model, cfg.name, device)
        out["flashtier_create_s"] = round(time.perf_counter() - t, 1)
        if model is not None:
            out["flashtier_weight_bytes"] = tensor_bytes(model)
            for row in out["rows"]:
                row["flashtier"] = stage(out, f"flashtier B={row['batch']}", flashtier_decode, model,
                                         inputs[row["batch"]], args.steps, device)
                save()
        del model
        gc.collect()  # the engines (and their CUDA graphs) are gone; release the cached blocks for HF's model
        if cuda:
            torch.cuda.empty_cache()
            out["device_allocated_after_free"] = torch.cuda.memory_allocated(device)
    save()
    if args.skip != "hf":
        hf_kw = stage(out, "HF config mapping", hf_config_dict, cfg, args.hf_layout)
        dtype = torch.bfloat16 if cuda else torch.float32
        hf = stage(out, "HF model", build_hf, hf_kw, dtype, device, args.hf_budget_gb, out) if hf_kw else None
        save()
        for row in out["rows"] if hf is not None else []:
            row["hf"] = stage(out, f"HF B={row['batch']}", hf_decode, hf, inputs[row["batch"]], args.steps, device)
            save()
    print(f"{'B':>4} {'flashtier tok/s':>16} {'HF tok/s':>10} {'ratio':>8}")
    for row in out["rows"]:
        f, h = (row.get(k) or {} for k in ("flashtier", "hf"))
        if f.get("tokens_per_s") and h.get("tokens_per_s"):
            row["ratio"] = round(f["tokens_per_s"] / h["tokens_per_s"], 2)
        print(f"{row['batch']:>4} {f.get('tokens_per_s', '-'):>16} {h.get('tokens_per_s', '-'):>10} "
              f"{row.get('ratio', '-'):>8}")
    print("".join(f"error in {e['stage']}: {e['error'][:200]}\n" for e in out["errors"]), end="")
    save()


if __name__ == "__main__":
    main()
