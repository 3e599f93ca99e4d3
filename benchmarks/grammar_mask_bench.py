"""Per-token mask cost of the two grammar engines vLLM and SGLang users rely on, on flashtier's vocabulary.

Both engines walk the same answer (a JSON object of a 4-property schema, 37 tokens + EOS) token by token:
fill the allowed-token bitmask, accept the token. Reports compile time and the per-token fill time
(mean, p50, max) and, as the ceiling this has to fit under, the ratio of the mean to the time one
sampling step of the batched sampler takes for the same row on this machine (the step the mask is
applied in). flashtier uses xgrammar (engine/grammar/compiler.py).

    .venv/bin/pip install llguidance==1.9.1   # the comparison engine; flashtier itself does not need it
    .venv/bin/python benchmarks/grammar_mask_bench.py --out docs/perf/grammar_mask.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

from importlib.metadata import version

import torch
import xgrammar as xgr

from flashtier.engine.grammar.compiler import GrammarCompiler
from flashtier.engine.grammar.constraint import ConstraintKind, ConstraintSpec
from flashtier.engine.sample.sampler import Sampler, SamplerRow
from flashtier.engine.sample.params import SamplingParams
from flashtier.server.grammar.service import grammar_vocab
from flashtier.server.text.tokenizer import Tokenizer, default_tokenizer_path

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["city", "days", "units", "tags"],
          "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1},
                         "units": {"enum": ["c", "f"]}, "tags": {"type": "array", "items": {"type": "string"}}}}
ANSWER = {"city": "Paris, the city of light", "days": 3, "units": "c", "tags": ["a", "bbb", "hello world"]}


def _stats(times: list[float]) -> dict[str, float]:
    us = [t * 1e6 for t in times]
    return {"mean_us": round(statistics.mean(us), 1), "p50_us": round(statistics.median(us), 1),
            "max_us": round(max(us), 1)}


def bench_xgrammar(tok: Tokenizer, ids: list[int]) -> dict:
    compiler = GrammarCompiler(grammar_vocab(tok, tok.vocab_size, (tok.eos_id,)))
    t0 = time.perf_counter()
    constraint = compiler.compile(ConstraintSpec(ConstraintKind.JSON_SCHEMA, json.dumps(SCHEMA), "bench"))
    compile_s = time.perf_counter() - t0
    matcher = xgr.GrammarMatcher(constraint.grammar)
    bitmask = xgr.allocate_token_bitmask(1, tok.vocab_size)
    times = []
    for t in ids:
        a = time.perf_counter()
        matcher.fill_next_token_bitmask(bitmask, 0)
        times.append(time.perf_counter() - a)
        assert matcher.accept_token(t), t
    return {"engine": f"xgrammar {version('xgrammar')}", "compile_ms": round(compile_s * 1e3, 1), **_stats(times)}


def bench_llguidance(tok: Tokenizer, ids: list[int]) -> dict:
    import llguidance  # only for this comparison: pip install llguidance==1.9.1
    import llguidance.torch
    t0 = time.perf_counter()
    lltok = llguidance.LLTokenizer(default_tokenizer_path().read_text(), n_vocab=tok.vocab_size, eos_token=tok.eos_id)
    matcher = llguidance.LLMatcher(lltok, llguidance.grammar_from("json_schema", json.dumps(SCHEMA)))
    compile_s = time.perf_counter() - t0
    bitmask = llguidance.torch.allocate_token_bitmask(1, tok.vocab_size)
    times = []
    for t in ids:
        a = time.perf_counter()
        llguidance.torch.fill_next_token_bitmask(matcher, bitmask, 0)
        times.append(time.perf_counter() - a)
        assert matcher.consume_token(t), matcher.get_error()
    return {"engine": f"llguidance {version('llguidance')}",
            "compile_ms_incl_tokenizer": round(compile_s * 1e3, 1), **_stats(times)}


def sampler_step_us(vocab: int) -> float:
    """One batch-1 sampling step (temperature 1, top-p 0.9) on this machine: the step the mask joins."""
    logits = torch.randn(1, vocab)
    rows = [SamplerRow(SamplingParams(temperature=1.0, top_p=0.9), generator=torch.Generator().manual_seed(0))]
    sampler = Sampler()
    for _ in range(3):
        sampler(logits, rows)
    t0 = time.perf_counter()
    for _ in range(20):
        sampler(logits, rows)
    return (time.perf_counter() - t0) / 20 * 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    tok = Tokenizer()
    ids = tok.encode(json.dumps(ANSWER), allow_special=False) + [tok.eos_id]
    step = sampler_step_us(tok.vocab_size)
    rows = [bench_xgrammar(tok, ids), bench_llguidance(tok, ids)]
    for r in rows:
        r["ratio_to_sampler_step"] = round(r["mean_us"] / step, 3)
    result = {"device": f"CPU ({platform.processor() or platform.machine()}), 1 thread", "vocab": tok.vocab_size,
              "tokens": len(ids), "sampler_step_us": round(step, 1),
              "command": "benchmarks/grammar_mask_bench.py --out docs/perf/grammar_mask.json", "rows": rows}
    print(json.dumps(result, indent=2))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
            f.write("\n")


if __name__ == "__main__":
    main()
