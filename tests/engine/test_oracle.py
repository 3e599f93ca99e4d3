"""The incremental path against the plain-torch oracle (engine/model/reference.py).

Tolerance: logits relative error (max |a - b| / max |b|) <= 1e-4 and identical greedy tokens. The
models run in float64 mode (numerics.py explains why fp32 cannot promise this between paths that
sum in a different order: a quantisation step or a top-k cut turns 1e-7 noise into a jump).
"""

import pytest
import torch

from flashtier.engine.model.incremental import IncrementalModel, greedy_generate
from flashtier.engine.model.reference import Plan, reference_forward

from .conftest import random_prompt, rel_err

TOL = 1e-4


def _check(logits_inc: list[torch.Tensor], tokens: list[int], ref: torch.Tensor) -> None:
    inc = torch.stack(logits_inc)
    assert ref.shape == inc.shape
    assert not torch.isnan(ref).any()
    assert rel_err(inc, ref) <= TOL
    assert torch.argmax(ref, -1).tolist() == tokens


def test_ced_prefill_and_decode_match_oracle_plan_b(tiny64, tiny_cfg):
    prompt = random_prompt(210, seed=11)
    runner = IncrementalModel(tiny64)
    tokens, logits = greedy_generate(runner, prompt, 300)
    seq = torch.tensor(prompt + tokens[:-1])
    ref = reference_forward(tiny64, seq, Plan.ced(len(prompt), seq.numel(), tiny_cfg.sliding_window))
    _check(logits, tokens, ref.logits)


def test_full_pass_plan_a_equals_incremental_without_decoder_replay(tiny64):
    prompt = random_prompt(120, seed=12)
    runner = IncrementalModel(tiny64)
    tokens, logits = greedy_generate(runner, prompt, 40, decoder_replay=False)
    seq = torch.tensor(prompt + tokens[:-1])
    ref = reference_forward(tiny64, seq, Plan.full(seq.numel(), logits_from=len(prompt) - 1))
    _check(logits, tokens, ref.logits)


def test_decoder_replay_changes_the_result(tiny64, tiny_cfg):
    """Plan (a) and plan (b) must differ for a prompt longer than the window (replay is real)."""
    prompt = torch.tensor(random_prompt(80, seed=13))
    a = reference_forward(tiny64, prompt, Plan.full(80, logits_from=79)).logits
    b = reference_forward(tiny64, prompt, Plan.ced(80, 80, tiny_cfg.sliding_window)).logits
    assert rel_err(a, b) > 1e-3


@pytest.mark.parametrize("chunk", [5, 64])
def test_chunked_prefill_equals_unchunked(tiny64, chunk):
    prompt = random_prompt(150, seed=14)
    runner = IncrementalModel(tiny64)
    whole = runner.prefill(runner.new_state(), prompt)
    parts = runner.prefill(runner.new_state(), prompt, chunk_size=chunk)
    assert rel_err(parts, whole) <= TOL
    assert int(torch.argmax(parts)) == int(torch.argmax(whole))


@pytest.mark.parametrize("resume_at", [16, 64, 96])
def test_encoder_bounded_replay_matches_oracle_plan_c(tiny64, tiny_cfg, resume_at):
    w = tiny_cfg.sliding_window
    prompt = random_prompt(140, seed=15)
    runner = IncrementalModel(tiny64)
    first = runner.new_state()
    runner.prefill(first, prompt[:resume_at + 10])  # the earlier turn that filled the cache
    state = runner.resume_replay(first, resume_at)
    logits = [runner.prefill(state, prompt[resume_at - w :])]
    tokens = [int(torch.argmax(logits[0]))]
    for _ in range(20):
        logits.append(runner.decode(state, tokens[-1]))
        tokens.append(int(torch.argmax(logits[-1])))
    seq = torch.tensor(prompt + tokens[:-1])
    ref = reference_forward(tiny64, seq, Plan.resume(resume_at, len(prompt), seq.numel(), w))
    _check(logits, tokens, ref.logits)
    cold = reference_forward(tiny64, seq, Plan.ced(len(prompt), seq.numel(), w)).logits
    if resume_at > w:  # replay from position 0 is a cold run; later starts truncate the window
        assert rel_err(ref.logits, cold) > 1e-6, "encoder replay should be approximate, not a cold run"
    else:
        assert rel_err(ref.logits, cold) <= TOL


def test_exact_resume_equals_uninterrupted(tiny64):
    """A snapshot (a copy of the state) continued later gives the same tokens as one long run."""
    prompt = random_prompt(90, seed=16)
    runner = IncrementalModel(tiny64)
    s1 = runner.new_state()
    runner.prefill(s1, prompt[:60])
    snap = s1.clone()
    runner.prefill(s1, prompt[60:])
    runner.prefill(snap, prompt[60:])
    a = [runner.decode(s1, 5) for _ in range(3)]
    b = [runner.decode(snap, 5) for _ in range(3)]
    for x, y in zip(a, b):
        assert torch.equal(x, y)


def test_changing_a_token_never_changes_earlier_logits(tiny64):
    """Causality. Not bit-equality: a changed token re-routes MoE rows, and a GEMM over a different set
    of rows may round differently; in float64 that noise is ~1e-15, far below the 1e-9 bound."""
    seq = torch.tensor(random_prompt(100, seed=17))
    base = reference_forward(tiny64, seq, Plan.full(100)).logits
    for t in (1, 37, 64, 99):
        other = seq.clone()
        other[t] = (other[t] + 1234) % 128000
        changed = reference_forward(tiny64, other, Plan.full(100)).logits
        assert rel_err(changed[:t], base[:t]) <= 1e-9, f"logits before {t} moved"
        assert rel_err(changed[t], base[t]) > 1e-3


def test_every_mechanism_bites(tiny64, tiny_cfg):
    """At these lengths top-k drops entries and the candidate pool restricts Reindex layers."""
    from flashtier.engine.model.indexer import candidate_pool

    cfg = tiny_cfg
    assert 210 // 2 > cfg.index_topk  # encoder streams: more visible entries than top-k
    pool = cfg.candidate_block_size * cfg.candidate_topk_blocks
    assert 210 > pool >= cfg.index_topk  # decoder: the pool is a strict subset
    scores = torch.rand(1, 210)
    allowed = candidate_pool(scores, torch.tensor([210]), cfg.candidate_block_size, cfg.candidate_topk_blocks)
    assert int(allowed.sum()) <= pool and bool(allowed[0, 209])
