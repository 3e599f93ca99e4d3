"""After the warm-up (engine/warmup.py), requests of shapes it never ran compile nothing (``-m gpu``).

The tiny model in the checkpoint formats (FP8 linears, MXFP4 experts: the kernels a real checkpoint runs) is
warmed at graph sizes 1 and 8, then serves batches the warm-up did not run: 8 prompts of 4 blocks (one chunk
of 8 sequences), then 5 of ragged lengths together. Triton reports every compile through its post-compile
hook (an in-process cache miss, whether or not its disk cache had the binary); each one would have been a
stall on the request path (0.2-0.5 s each on an H100). The kernels whose arguments count tokens, pairs or
tiles keep those arguments unspecialised (their ``*_COUNTS`` tuples): without that, Triton compiled 19 new
variants for the first batch of 64 after a full warm-up (benchmarks/warmup_bench.py --profile-first, H100).
"""

import os

import pytest
import torch

from flashtier.engine.config import EngineConfig
from flashtier.engine.engine import Engine
from flashtier.engine.sample.params import SamplingParams
from flashtier.engine.warmup import warm_up
from flashtier.kvstore.config import KVStoreConfig

from .conftest import random_prompt
from .gpu_models import tiny_on_cuda

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="needs compiled Triton"),
]


def _serve(engine, lengths, seed):
    for i, n in enumerate(lengths):
        engine.add_request(f"s{seed}-{i}", random_prompt(n, seed=seed + i),
                           SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()


def test_no_compile_after_warm_up():
    from triton import knobs

    cfg = EngineConfig(max_num_batched_tokens=512, max_num_seqs=8, forward="batched", dtype="bfloat16",
                       device="cuda", cuda_graph_sizes=(1, 8))
    engine = Engine(tiny_on_cuda("checkpoint"), cfg, KVStoreConfig(block_size=16, num_blocks=600))
    warm_up(engine)
    compiled = []
    hook = knobs.runtime.jit_post_compile_hook
    knobs.runtime.jit_post_compile_hook = lambda **kw: compiled.append(kw["repr"].split("[")[0])
    try:
        _serve(engine, [64] * 8, seed=100)
        _serve(engine, [37, 5, 90, 61, 18], seed=200)
    finally:
        knobs.runtime.jit_post_compile_hook = hook
    assert compiled == [], f"compiled after the warm-up: {compiled}"


def test_speculative_steps_capture_nothing_after_warm_up():
    """A speculative engine (fixed depth 3: every decode step verifies) warmed at graph sizes 1 and 8 serves
    greedy and sampled requests without a new verify or draft graph captured or a kernel compiled on the request
    path, and its verify and draft graphs replay (short prompts: the smallest block-table bucket)."""
    from triton import knobs

    cfg = EngineConfig(max_num_batched_tokens=512, max_num_seqs=8, forward="batched", dtype="bfloat16",
                       device="cuda", cuda_graph_sizes=(1, 8), speculative_tokens=3, speculative_adaptive=False)
    engine = Engine(tiny_on_cuda("checkpoint", with_dspark=True), cfg, KVStoreConfig(block_size=16, num_blocks=600))
    report = warm_up(engine)
    graphs, drafts = engine.runner.paged.graphs, engine.drafter.graphs
    assert drafts is not None and report.verify_graphs > 0
    captures, draft_captures = graphs.captures, drafts.captures
    compiled = []
    hook = knobs.runtime.jit_post_compile_hook
    knobs.runtime.jit_post_compile_hook = lambda **kw: compiled.append(kw["repr"].split("[")[0])
    try:
        runs, draft_runs = graphs.runs, drafts.runs
        _serve(engine, [20, 9, 33], seed=300)
        for i, n in enumerate([12, 25]):
            engine.add_request(f"t{i}", random_prompt(n, seed=400 + i),
                               SamplingParams(temperature=0.8, seed=i, max_tokens=5, ignore_eos=True))
        while engine.has_unfinished():
            engine.step()
    finally:
        knobs.runtime.jit_post_compile_hook = hook
    assert compiled == [], f"compiled after the warm-up: {compiled}"
    assert (graphs.captures, drafts.captures) == (captures, draft_captures)
    assert graphs.runs > runs and drafts.runs > draft_runs
