"""The incremental path against the plain-torch oracle (engine/model/reference.py), in float64.

Tolerances, as tight as the paths achieve (numerics.py says why fp32 cannot promise this between paths
that sum in a different order: a quantisation step or a top-k cut turns 1e-7 noise into a jump):

- against the oracle: ``reference_forward`` hands its logits out in fp32, so the incremental float64 logits
  must equal them up to that rounding: |inc - ref| <= 2^-24 |inc| + TOL_ORACLE * max |ref|, TOL_ORACLE =
  1e-12 (measured: every element inside the rounding term alone on plans (a), (b), (c) and the resumes; the
  plain relative error max |inc - ref| / max |ref| is 4.0e-8 to 5.0e-8, the fp32 rounding itself);
  identical greedy tokens;
- between two float64 incremental runs (chunked vs whole prefill, snapshot resume vs uninterrupted):
  relative error (max |a - b| / max |b|) <= TOL_F64 = 1e-12 (measured: 5.0e-16 and 4.2e-16).
"""

import copy

import pytest
import torch

from flashtier.engine.model.incremental import IncrementalModel, greedy_generate
from flashtier.engine.model.reference import Plan, reference_forward

from .conftest import random_prompt, rel_err

TOL_ORACLE = 1e-12
TOL_F64 = 1e-12
FP32_ROUNDING = 2.0**-24  # unit roundoff of the oracle's fp32 logits


def oracle_excess(inc: torch.Tensor, ref: torch.Tensor) -> float:
    """How far float64 ``inc`` is from the fp32 oracle ``ref`` beyond ref's own rounding, relative to max |ref|."""
    ref = ref.double()
    return float(((inc - ref).abs() - FP32_ROUNDING * inc.abs()).max() / ref.abs().max())


def _check(logits_inc: list[torch.Tensor], tokens: list[int], ref: torch.Tensor) -> None:
    inc = torch.stack(logits_inc)
    assert ref.shape == inc.shape and inc.dtype == torch.float64
    assert not torch.isnan(ref).any()
    assert oracle_excess(inc, ref) <= TOL_ORACLE
    assert torch.argmax(ref, -1).tolist() == tokens


def test_ced_prefill_and_decode_match_oracle_plan_b(tiny64, tiny_cfg):
    prompt = random_prompt(210, seed=11)
    runner = IncrementalModel(tiny64)
    tokens, logits = greedy_generate(runner, prompt, 40)  # past the window twice, 5 candidate blocks
    seq = torch.tensor(prompt + tokens[:-1])
    ref = reference_forward(tiny64, seq, Plan.ced(len(prompt), seq.numel(), tiny_cfg.sliding_window))
    _check(logits, tokens, ref.logits)


def test_full_pass_plan_a_equals_incremental_without_decoder_replay(tiny64):
    prompt = random_prompt(120, seed=12)
    runner = IncrementalModel(tiny64)
    tokens, logits = greedy_generate(runner, prompt, 16, decoder_replay=False)
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
    assert rel_err(parts, whole) <= TOL_F64
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
    for _ in range(10):
        logits.append(runner.decode(state, tokens[-1]))
        tokens.append(int(torch.argmax(logits[-1])))
    seq = torch.tensor(prompt + tokens[:-1])
    ref = reference_forward(tiny64, seq, Plan.resume(resume_at, len(prompt), seq.numel(), w))
    _check(logits, tokens, ref.logits)
    cold = reference_forward(tiny64, seq, Plan.ced(len(prompt), seq.numel(), w)).logits
    if resume_at > w:  # replay from position 0 is a cold run; later starts truncate the window
        assert rel_err(ref.logits, cold) > 1e-6, "encoder replay should be approximate, not a cold run"
    else:
        assert torch.equal(ref.logits, cold)


def drop_window_keys(state):
    """A broken snapshot: deep copy, but the encoder's window rings come back empty."""
    snap = state.clone()
    for ring in snap.rings:
        ring.clear()
    return snap


def zero_last_entry(state):
    """A broken snapshot: deep copy, but every KV source's newest global entry reads back as zeros."""
    snap = state.clone()
    for store in snap.stores.values():
        store.main[store.count - 1] = 0.0
        store.index_k[store.count - 1] = 0.0
    return snap


RESUME_PROMPT, RESUME_DECODE = random_prompt(70, seed=16), [5, 77, 1234]


def resume_error(model, cut: int, snapshot) -> float:
    """Relative logit error of a sequence resumed from ``snapshot(state at cut)`` against one never cut.

    The state that was cut goes on with tokens of another turn before the snapshot is used, so a snapshot
    that shares storage with it is corrupted, as one kept in a pool would be.
    """
    runner = IncrementalModel(model)
    whole = runner.new_state()
    expect = [runner.prefill(whole, RESUME_PROMPT)] + [runner.decode(whole, t) for t in RESUME_DECODE]
    state = runner.new_state()
    runner.prefill(state, RESUME_PROMPT[:cut])
    snap = snapshot(state)
    runner.prefill(state, [9, 10, 11])
    got = [runner.prefill(snap, RESUME_PROMPT[cut:])] + [runner.decode(snap, t) for t in RESUME_DECODE]
    return rel_err(torch.stack(got), torch.stack(expect))


@pytest.mark.parametrize("cut", [53, 61])  # n - W - 1 and n - 9 (n = 70, W = 16); odd: a ratio-2 group is open
def test_exact_resume_equals_uninterrupted(tiny64, tiny_cfg, cut):
    """A snapshot taken at ``cut`` and continued later gives the logits of one uninterrupted run (and of the
    oracle's cold run, plan (b))."""
    assert resume_error(tiny64, cut, lambda s: s.clone()) <= TOL_F64
    runner = IncrementalModel(tiny64)
    state = runner.new_state()
    runner.prefill(state, RESUME_PROMPT[:cut])
    snap = state.clone()
    logits = [runner.prefill(snap, RESUME_PROMPT[cut:])] + [runner.decode(snap, t) for t in RESUME_DECODE]
    seq = torch.tensor(RESUME_PROMPT + RESUME_DECODE)
    ref = reference_forward(tiny64, seq, Plan.ced(len(RESUME_PROMPT), seq.numel(), tiny_cfg.sliding_window))
    assert oracle_excess(torch.stack(logits), ref.logits) <= TOL_ORACLE


@pytest.mark.parametrize(
    "broken", [drop_window_keys, zero_last_entry, copy.copy], ids=["no-window", "bad-entry", "shallow"]
)
def test_exact_resume_check_catches_a_broken_snapshot(tiny64, broken):
    """The resume check above fails (error ~1) for a snapshot that loses state or shares storage with the
    live state (``copy.copy``: the other turn's tokens land in the snapshot too)."""
    assert resume_error(tiny64, 53, broken) > 1e-3


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
