"""Exact resume from any snapshot point P < n (float64, tiny preset, window 16, block size 16).

Turn 1 feeds a prompt A of 45 tokens: its prompt-end snapshot lies at P = 45 (2 full blocks + a 13-token
tail block). Turn 2 sends A + d new tokens, n = 45 + d, for d = 1, 9, 15, 16, 17: P = n - 1, n - 9,
n - 15, n - window, n - window - 1. For d < window the decoder replay over [n - 16, n) starts below P;
its input there comes from the snapshot's replay tail. Each resumed turn must be a snapshot hit (not a
bounded replay) whose logits equal an uninterrupted (cold, cache-less) run of the same prompt within
1e-12 relative, with the same greedy tokens. The last test breaks the resume on purpose (the installed
replay tail zeroed) and shows that the same comparison catches it.

The five turns 2 run as one batch (and so do their cold runs), to keep the file fast. Both CPU forwards
run (per-sequence, and the batched one the GPU uses). The ``gpu`` variants repeat it on CUDA and require the
resumed logits to be bit-identical to the uninterrupted run (``torch.equal``): in float32, and in bf16 with the
checkpoint formats at the real index width (the kernels a real checkpoint runs, CUDA graphs on). That needs
every kernel to be batch invariant: the cold run computes the same rows in other batches and chunks.
"""

import copy
import dataclasses
import os
import time
from types import SimpleNamespace

import pytest
import torch

from flashtier.engine.tiers import resume
from flashtier.engine.config import EngineConfig
from flashtier.engine.engine import Engine
from flashtier.engine.sample.params import SamplingParams
from flashtier.engine.tiers.manager import TierManager
from flashtier.kvstore.config import KVStoreConfig

from .conftest import random_prompt, rel_err

BS, W, P = 16, 16, 45
DS = (1, 9, 15, W, W + 1)  # new tokens after the snapshot point
GREEDY = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
TOL = 1e-12  # float64 on the CPU (measured: 0 for every row but one, 5.6e-16)
TOL_CUDA = 0.0  # CUDA: bit-identical (batch-invariant kernels; measured on the H200)


def _capture(engine: Engine) -> dict[str, list[torch.Tensor]]:
    """Record every decoder row's logits by request id (wraps ``engine.runner.execute``)."""
    rows: dict[str, list[torch.Tensor]] = {}
    inner = engine.runner.execute

    def execute(batch):
        out = inner(batch)
        for i, work in enumerate(batch.decoder):
            rows.setdefault(work.request.request_id, []).append(out.logits[i].clone())
        return out

    engine.runner.execute = execute
    return rows


def _serve(engine: Engine, prompts: dict[str, list[int]]) -> dict[str, tuple[list[int], object]]:
    """Run the requests together; (greedy tokens, last RequestOutput) by request id."""
    for rid, prompt in prompts.items():
        engine.add_request(rid, prompt, GREEDY)
    tokens: dict[str, list[int]] = {rid: [] for rid in prompts}
    last = {}
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id] += [t for c in out.choices for t in c.token_ids]
            last[out.request_id] = out
        engine.check_integrity()
        if engine.scheduler.loading:
            time.sleep(0.002)  # a tier lookup is in flight on the I/O thread
    if engine.tiers is not None:
        for fut in list(engine.tiers._pending):  # the puts of these turns' snapshots
            fut.result(timeout=10)
    return {rid: (tokens[rid], last[rid]) for rid in prompts}


CUDA = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
        pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="needs compiled Triton")]


@pytest.fixture(scope="module", params=[
    pytest.param(("cpu", "per-sequence"), id="cpu-per-sequence"),
    pytest.param(("cpu", "batched"), id="cpu-batched"),  # the forward the GPU runs, kernels as references
    pytest.param(("cuda", "auto"), id="cuda", marks=CUDA),
    pytest.param(("cuda-checkpoint", "batched"), id="cuda-bf16-checkpoint", marks=CUDA),
])
def runs(request, tiny64):
    device, forward = request.param
    config = EngineConfig(forward=forward)
    if device == "cpu":
        model, tol = tiny64, TOL
    elif device == "cuda":
        model, tol = copy.deepcopy(tiny64).float().cuda(), TOL_CUDA
    else:
        from .gpu_models import tiny_on_cuda

        model, tol = tiny_on_cuda("checkpoint", seed=5), TOL_CUDA
        config = EngineConfig(forward=forward, dtype="bfloat16", device="cuda")
    prompt_a = random_prompt(P, seed=70)
    prompts = {f"b{d}": prompt_a + random_prompt(d, seed=100 + d) for d in DS}
    kv = KVStoreConfig(block_size=BS, num_blocks=128)
    engine = Engine(model, config, kv, TierManager(kv))  # embedded snapshot pool, no SSD
    logits = _capture(engine)
    first = _serve(engine, {"a": prompt_a})["a"][1]
    assert first.resume.kind == "cold" and engine.stats().tiers["snapshot_puts"] == 2  # prompt end, generation end
    before = dict(engine.stats().tiers)
    resumed = _serve(engine, prompts)
    after = engine.stats().tiers
    counts = {k: after[k] - before[k] for k in ("snapshot_lookup_hit", "snapshot_lookup_error", "snapshot_lookup_miss")}
    # the uninterrupted runs: a fresh engine without prefix cache or tiers
    cold_engine = Engine(model, config, KVStoreConfig(block_size=BS, num_blocks=64, enable_prefix_caching=False))
    cold_logits = _capture(cold_engine)
    cold = _serve(cold_engine, prompts)
    yield SimpleNamespace(engine=engine, prompts=prompts, resumed=resumed, logits=logits, counts=counts, tol=tol,
                          cold={rid: (cold[rid][0], cold_logits[rid]) for rid in prompts})
    engine.close()


@pytest.mark.parametrize("d", DS, ids=lambda d: f"P=n-{d}")
def test_resume_from_any_point_equals_the_uninterrupted_run(runs, d):
    rid = f"b{d}"
    tokens, out = runs.resumed[rid]
    want_tokens, want_logits = runs.cold[rid]
    got_logits = runs.logits[rid]
    assert tokens == want_tokens and len(got_logits) == len(want_logits) == GREEDY.max_tokens
    for got, want in zip(got_logits, want_logits):
        assert torch.equal(got, want) if runs.tol == 0 else rel_err(got, want) <= runs.tol
    # resumed at P from the snapshot: nothing re-encoded below P, only the decoder's window replayed
    assert (out.resume.kind, out.resume.replay_from) == ("exact", None)
    c = out.cache
    assert (c.cached_tokens, c.hbm_tokens, c.snapshot_tokens, c.computed_tokens) == (P, 32, P - 32, d)
    assert (c.decoder_tokens, c.approximate_replay_tokens) == (W, 0)  # the decoder's window alone, nothing approximate


def test_every_turn_was_a_snapshot_hit(runs):
    assert runs.counts == {"snapshot_lookup_hit": len(DS), "snapshot_lookup_error": 0, "snapshot_lookup_miss": 0}


def test_a_resume_with_its_replay_tail_zeroed_is_caught(runs, monkeypatch):
    """The same check on a deliberately broken resume: the snapshot installs with its replay tail zeroed."""
    decode = resume.decode_snapshot

    def zeroed(*args, **kwargs):
        snap = decode(*args, **kwargs)
        return dataclasses.replace(snap, tail_x=torch.zeros_like(snap.tail_x))

    monkeypatch.setattr(resume, "decode_snapshot", zeroed)
    prompt = runs.prompts["b9"]  # asked again: b9's own prompt-end snapshot at P = n = 54 is the best point
    out = _serve(runs.engine, {"broken": prompt})["broken"][1]
    assert out.resume.kind == "exact" and out.cache.snapshot_tokens == len(prompt) - 48  # still reported as a hit
    got, want = runs.logits["broken"][0], runs.cold["b9"][1][0]
    assert rel_err(got, want) > 1e-3  # the resume check above would fail
