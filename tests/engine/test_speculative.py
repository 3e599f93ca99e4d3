"""DSpark speculative decoding in the engine (float64 tiny model with its drafter stages).

- Greedy: 32 requests in one batch (chunked prefill, an n = 2 request, a quarter of the sequences kept on
  plain decoding so VERIFY and DECODE work share steps) give the same tokens with speculation on and off,
  with the engine's integrity check (pool, tables, speculative state) after every step. Random weights make
  the real drafter nearly always wrong (rejections: the rollback path); a drafter forced to propose the
  target's own greedy continuation, wrong from a varying position on, gives every acceptance length.
- The test can fail: a broken acceptance rule (one draft too many accepted) changes the tokens; skipping the
  rollback is caught by the integrity check.
- After every step the rolled-back KV state (tokens, every layer's ring, ratio-2 groups, replay tail, entry
  counts and entries) equals plain decoding's at the same length; blocks past the kept tokens are released.
- The per-sequence forward (the other path) with chunked prefill; preemption while drafts are pending; an
  exact resume from the snapshot of a speculated turn; a stop token and logprobs inside accepted drafts.
- Sampling: the acceptance rule against its target over a small vocabulary (chi-square, fixed seeds, and a
  broken residual caught); the engine's sampled tokens against plain sampling (two-sample chi-square).
"""

from __future__ import annotations

import json
import time
from collections import Counter

import pytest
import torch

from flashtier.engine.spec import accept as spec_accept, verify as spec_verify
from flashtier.engine.config import EngineConfig
from flashtier.engine.engine import Engine
from flashtier.engine.model.init import random_model
from flashtier.engine.sample.params import SamplingParams
from flashtier.engine.core.scheduler_output import DecoderKind
from flashtier.kvstore.config import KVStoreConfig

from .conftest import random_prompt
from .spec_harness import (DEPTH, GREEDY, FakeClock, chi2_sf, force_drafts, kv_state, make, plain_quarter, run,
                           same_state, two_sample_p, watch_steps)


@pytest.fixture(scope="module")
def model(tiny_cfg):
    return random_model(tiny_cfg, seed=1, dtype=torch.float64, with_dspark=True)


REQUESTS = [(f"r{i}", random_prompt(4 + (7 * i) % 17, seed=900 + i), SamplingParams(n=2 if i == 5 else 1, **GREEDY))
            for i in range(32)]


@pytest.fixture(scope="module")
def plain(model):
    return run(make(model, spec=0), REQUESTS)


def test_greedy_equal_with_the_real_drafter(model, plain):
    eng = make(model)
    plain_quarter(eng)
    steps = watch_steps(eng)
    assert run(eng, REQUESTS) == plain
    s = eng.stats()
    assert s.spec_draft_tokens > 100 and sum(s.spec_acceptance_lengths) == s.spec_drafts
    mixed = {DecoderKind.VERIFY, DecoderKind.DECODE, DecoderKind.REPLAY}
    assert any(kinds >= mixed and prefill for kinds, prefill in steps)  # all kinds and a prompt chunk in one step


def test_greedy_equal_with_accepted_drafts(model, plain):
    eng = make(model)
    plain_quarter(eng)
    force_drafts(eng, plain)
    assert run(eng, REQUESTS) == plain
    s = eng.stats()
    assert all(n > 0 for n in s.spec_acceptance_lengths), s.spec_acceptance_lengths  # every length 0..DEPTH
    assert s.spec_accepted_tokens == sum(k * n for k, n in enumerate(s.spec_acceptance_lengths))


def test_a_broken_acceptance_rule_is_caught(model, plain, monkeypatch):
    reqs = REQUESTS[:8]
    want = {k: v for k, v in plain.items() if k[0] in {r for r, _, _ in reqs}}

    right_rule = spec_accept.accept_greedy

    def one_too_many(target, drafts):  # accepts the first mismatching draft as well
        out = right_rule(target, drafts)
        return out[:-1] + [drafts[len(out) - 1]] + [7] if len(out) <= len(drafts) else out

    eng = make(model)
    force_drafts(eng, want)
    monkeypatch.setattr(spec_verify.spec_accept, "accept_greedy", one_too_many)
    assert run(eng, reqs) != want
    monkeypatch.undo()
    eng = make(model)
    force_drafts(eng, want)
    monkeypatch.setattr(spec_verify, "keep_point", lambda n0, rows, right, align: n0 + rows)  # no rollback
    with pytest.raises(RuntimeError, match="KV holds"):
        run(eng, reqs)


def test_logprobs_and_stop_tokens_inside_accepted_drafts(model, plain):
    """A stop token met among accepted drafts ends the choice there (not returned, as without speculation);
    the logprobs of accepted drafts are those of plain decoding."""
    stop = plain[("r3", 0)][2]
    reqs = [("r3", REQUESTS[3][1], SamplingParams(stop_token_ids=(stop,), **GREEDY)),
            ("r4", REQUESTS[4][1], SamplingParams(logprobs=2, **GREEDY))]
    seen = {True: [], False: []}
    for spec in (False, True):
        eng = make(model, spec=DEPTH if spec else 0)
        if spec:
            force_drafts(eng, plain, wrong_from=lambda rid, done: DEPTH)
        run(eng, reqs, choices=seen[spec])
    merged = {}
    for spec, deltas in seen.items():
        for rid, c in deltas:
            toks, lps, reason = merged.setdefault((spec, rid), ([], [], []))
            toks.extend(c.token_ids)
            lps.extend(c.logprobs or ())
            reason.append(c.finish_reason)
    assert merged[(True, "r3")][0] == merged[(False, "r3")][0] == plain[("r3", 0)][:2]
    assert merged[(True, "r3")][2][-1] == "stop"
    a, b = merged[(True, "r4")][1], merged[(False, "r4")][1]
    assert [x.token_id for x in a] == [x.token_id for x in b] == plain[("r4", 0)] and len(a) == 6
    for x, y in zip(a, b):
        assert x.rank == y.rank and abs(x.logprob - y.logprob) < 1e-6
        assert [t for t, _ in x.top] == [t for t, _ in y.top]


def test_rollback_restores_the_plain_state(model):
    reqs = [(rid, prompt, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
            for rid, prompt, _ in (REQUESTS[1], REQUESTS[6])]
    states = {}

    def record(engine):
        for req in engine.requests.values():
            for seq in req.live_seqs:
                states[(req.request_id, len(seq.kv.tokens))] = kv_state(seq)

    want = run(make(model, spec=0), reqs, on_step=record)
    lags = []

    def compare(engine):
        bs = engine.layout.block_size
        for req in engine.requests.values():
            for seq in req.live_seqs:
                if seq.spec is not None:
                    n = len(seq.kv.tokens)
                    same_state(kv_state(seq), states[(req.request_id, n)])
                    assert len(seq.kv.table) == -(-n // bs)  # blocks past the kept tokens went back
                    lags.append(len(req.prompt) + len(seq.output) - n)

    eng = make(model)
    force_drafts(eng, want, wrong_from=lambda rid, done: (1, 0, 3, 2)[done % 4])
    assert run(eng, reqs, on_step=compare) == want
    # compared after rollbacks to n0 and past it, with an accepted token kept back (lag 2) and without
    assert len(lags) >= 6 and set(lags) == {1, 2} and eng.stats().spec_acceptance_lengths[0] > 0


def test_per_sequence_forward_with_chunked_prefill(model, plain):
    reqs = REQUESTS[:6]
    eng = make(model, forward="per-sequence", budget=16)
    force_drafts(eng, plain)
    got = run(eng, reqs)
    assert got == {k: v for k, v in plain.items() if k[0] in {r for r, _, _ in reqs}}
    assert eng.runner.paged is None and eng.stats().spec_accepted_tokens > 0


def test_preemption_mid_speculation_keeps_greedy_outputs(model, plain):
    reqs = REQUESTS[:6]
    want = {k: v for k, v in plain.items() if k[0] in {r for r, _, _ in reqs}}
    small = make(model, blocks=12)  # 11 usable blocks of 8 tokens; the six (seven sequences) need 17 at the end
    force_drafts(small, want)
    pending = []
    preempt = small.scheduler._preempt

    def watch(req, out):
        pending.extend(bool(s.spec and s.spec.drafts) for s in req.live_seqs)
        return preempt(req, out)

    small.scheduler._preempt = watch
    assert run(small, reqs) == want
    assert small.stats().preemptions > 0 and any(pending), "no sequence was preempted with drafts pending"


def test_exact_resume_of_a_speculated_turn(model):
    """Turn 1 speculates and snapshots at generation end (its KV state lags its tokens); turn 2 (turn 1 + new
    tokens) resumes exactly from that snapshot and, speculating again, equals a cold plain run."""
    from flashtier.engine.tiers.manager import TierManager

    first = [("t1", random_prompt(21, seed=77), SamplingParams(**GREEDY))]
    want1 = run(make(model, spec=0), first)
    second = [("t2", first[0][1] + want1[("t1", 0)] + random_prompt(5, seed=78), SamplingParams(**GREEDY))]
    want2 = run(make(model, spec=0), second)
    kv = KVStoreConfig(block_size=8, num_blocks=200)
    eng = Engine(model, EngineConfig(max_num_batched_tokens=96, dtype="float64", forward="batched",
                                     speculative_tokens=DEPTH, speculative_adaptive=False), kv, TierManager(kv))
    try:
        force_drafts(eng, {**want1, **want2})
        assert run(eng, first) == want1
        for fut in list(eng.tiers._pending):  # the generation-end snapshot's put
            fut.result(timeout=10)
        outs = []
        eng.add_request(*second[0])
        got = []
        while eng.has_unfinished():
            for o in eng.step():
                got += [t for c in o.choices for t in c.token_ids]
                outs.append(o)
            eng.check_integrity()
            if eng.scheduler.loading:
                time.sleep(0.002)  # the tier lookup runs on the I/O thread
        assert got == want2[("t2", 0)] and outs[-1].resume.kind == "exact"
        assert outs[-1].cache.snapshot_tokens > 0 and eng.stats().spec_accepted_tokens > 0
    finally:
        eng.close()


@pytest.mark.parametrize("q_kind", ["greedy", "sampled"])
def test_rejection_sampling_follows_the_target(q_kind):
    """Two drafts over a 6-token vocabulary: the first emitted token must follow p[0], the second (given the
    first was accepted) p[1]; a residual drawn from p instead of max(p - q, 0) is caught."""
    g = torch.Generator().manual_seed(5)
    p = torch.tensor([[0.35, 0.25, 0.2, 0.1, 0.1, 0.0], [0.1, 0.5, 0.1, 0.1, 0.1, 0.1], [1 / 6] * 6])
    q = torch.tensor([[0.1, 0.1, 0.5, 0.1, 0.1, 0.1], [0.4, 0.1, 0.1, 0.1, 0.2, 0.1]])

    def sample(rule, n=6000):
        first, second = Counter(), Counter()
        for _ in range(n):
            d0 = int(torch.multinomial(q[0], 1, generator=g)) if q_kind == "sampled" else 0
            d1 = int(torch.multinomial(q[1], 1, generator=g)) if q_kind == "sampled" else 1
            out = rule(p, [d0, d1], q if q_kind == "sampled" else None, g)
            first[out[0]] += 1
            if out[0] == d0 and len(out) > 1:
                second[out[1]] += 1
        return first, second

    def p_value(counts: Counter, probs: torch.Tensor) -> float:
        n = sum(counts.values())
        cats = [c for c in range(6) if probs[c] > 0]
        assert all(counts[c] == 0 for c in range(6) if probs[c] == 0)
        stat = sum((counts[c] - n * float(probs[c])) ** 2 / (n * float(probs[c])) for c in cats)
        return chi2_sf(stat, len(cats) - 1)

    first, second = sample(spec_accept.accept_sampled)
    assert p_value(first, p[0]) > 0.01
    assert sum(second.values()) > 500

    def residual_from_p(pp, drafts, qq, gen):  # broken: the rejection resamples from p itself
        qq = qq if qq is not None else torch.nn.functional.one_hot(torch.tensor(drafts), 6).double()
        u = torch.rand((), generator=gen, dtype=torch.float64)
        if u * qq[0, drafts[0]] < pp[0, drafts[0]]:
            return [drafts[0]]
        return [spec_accept.draw(pp[0], gen)]

    bad, _ = sample(residual_from_p)
    assert p_value(bad, p[0]) < 1e-4


def test_sampled_tokens_follow_plain_sampling(model, plain):
    """Seeded sampled choices (top-k 3) of two prompts: the pairs of their first two tokens with speculation
    (the real drafter: sampled drafts, nearly all rejected; a greedy drafter proposing the plain greedy
    continuation: acceptances) against plain sampling, two-sample chi-square; a rule that accepts every
    draft is caught."""
    prompts = {"a": REQUESTS[2][1], "b": REQUESTS[9][1]}
    greedy_path = {"a": plain[("r2", 0)], "b": plain[("r9", 0)]}

    def params(n, seed):
        return SamplingParams(n=n, temperature=1.0, top_k=3, seed=seed, max_tokens=3, ignore_eos=True)

    def pairs(out, arm):
        return Counter((rid[0], tuple(toks[:2])) for (rid, _), toks in out.items() if rid.endswith(arm))

    def forced(eng, arm):
        want = {(p + arm, c): greedy_path[p] for p in prompts for c in range(16)}
        real = eng.drafter.propose
        force_drafts(eng, want, wrong_from=lambda rid, done: DEPTH)
        mine = eng.drafter.propose
        eng.drafter.propose = lambda live, n: (mine([x for x in live if x[0].request_id.endswith(arm)], n),
                                               real([x for x in live if not x[0].request_id.endswith(arm)], n))

    base = pairs(run(make(model, spec=0), [(p + "P", pr, params(32, 11 + i)) for i, (p, pr) in
                                           enumerate(prompts.items())]), "P")
    eng = make(model)
    forced(eng, "F")
    out = run(eng, [(p + arm, pr, params(16, 21 + 2 * i + j)) for i, (p, pr) in enumerate(prompts.items())
                    for j, arm in enumerate("FR")])
    assert two_sample_p(pairs(out, "F"), base) > 0.01 and two_sample_p(pairs(out, "R"), base) > 0.01
    assert eng.stats().spec_accepted_tokens > 2
    eng = make(model)
    forced(eng, "F")
    eng.postprocessor.verifier._accept = lambda w, greedy, probs: list(w.drafts) + [int(greedy[-1])]
    out = run(eng, [(p + "F", pr, params(16, 21 + 2 * i)) for i, (p, pr) in enumerate(prompts.items())])
    assert two_sample_p(pairs(out, "F"), base) < 1e-3


def test_confidence_schedules_the_verify_length():
    from flashtier.engine.spec.schedule import SpecPolicy

    conf = torch.tensor([2.0, 0.0, -3.0, 5.0])  # sigmoid 0.88, 0.5, 0.047, 0.99: all-accepted 0.88, 0.44, 0.02
    lengths = {tau: SpecPolicy(4, tau, 1 << 20, 16).verify_length(conf, 4) for tau in (0.0, 0.1, 0.5, 0.9)}
    assert lengths == {0.0: 4, 0.1: 2, 0.5: 1, 0.9: 0}
    assert SpecPolicy(3, 0.5, 1 << 20, 16).verify_length(None, 5) == 3  # no scores: up to the depth


def test_speculative_settings_and_metrics(model):
    from prometheus_client import generate_latest

    from flashtier.server.cli import build_parser
    from flashtier.server.serving.metrics import ServerMetrics
    from flashtier.server.config.settings import build_settings

    assert build_settings(None, {}).engine_config().speculative_tokens == 0  # off by default
    argv = ["serve", "--speculative-config", json.dumps({"method": "dspark", "num_speculative_tokens": 2})]
    vllm = build_settings(build_parser().parse_args(argv), {}).engine_config()
    assert (vllm.speculative_tokens, vllm.speculative_min_confidence) == (2, 0.1)
    assert build_settings(build_parser().parse_args(["serve", "--speculative", "3"]), {}).speculative == 3
    assert build_settings(None, {"FLASHTIER_SPECULATIVE": "on"}).speculative == 5
    for bad in ('{"method": "ngram", "num_speculative_tokens": 2}', "7", '{"num_speculative_tokens": 2, "x": 1}'):
        with pytest.raises(ValueError, match="FLASHTIER_SPECULATIVE"):
            build_settings(None, {"FLASHTIER_SPECULATIVE": bad})
    with pytest.raises(ValueError, match="speculative_tokens"):
        make(model, spec=6)
    eng = make(model)
    run(eng, [("m", [5, 6, 7], SamplingParams(**GREEDY))])
    stats = eng.stats()
    text = generate_latest(ServerMetrics("m", stats=lambda: stats).registry).decode()
    assert f'flashtier_spec_decode_num_draft_tokens_total{{model_name="m"}} {float(stats.spec_draft_tokens)}' in text
    assert 'flashtier_spec_decode_acceptance_length_bucket{le="0.0",model_name="m"}' in text
    assert len(stats.spec_accepted_by_position) == DEPTH and stats.spec_steps_by_draft_length[DEPTH] > 0
    for j, n in enumerate(stats.spec_accepted_by_position):
        assert (f'flashtier_spec_decode_num_accepted_tokens_per_pos_total{{model_name="m",position="{j}"}} '
                f'{float(n)}') in text
    assert f'flashtier_spec_decode_draft_length{{model_name="m"}} {float(DEPTH)}' in text
    assert (f'flashtier_spec_decode_steps_total{{draft_length="{DEPTH}",model_name="m"}} '
            f'{float(stats.spec_steps_by_draft_length[DEPTH])}') in text
    assert build_settings(None, {}).engine_config().speculative_adaptive
    off = build_parser().parse_args(["serve", "--speculative", "3", "--no-speculative-adaptive"])
    assert not build_settings(off, {}).engine_config().speculative_adaptive
    assert not build_settings(None, {"FLASHTIER_SPECULATIVE_ADAPTIVE": "0"}).speculative_adaptive


LONG = [(f"c{i}", random_prompt(5 + 3 * i, seed=700 + i), SamplingParams(temperature=0, max_tokens=72, ignore_eos=True))
        for i in range(2)]


def phased_cost(engine, clock):
    """Advance ``clock`` by each forward's scripted cost: drafting is cheap in steps 0-13 (the controller climbs
    to 3 drafts), then 1 draft is the best buy (steps 14-21), then drafting costs 10x a plain step (off).
    Returns [(draft length, sequences decoding)] per step."""
    execute, steps = engine.runner.execute, []

    def timed(batch):
        drafts = max((len(w.drafts) for w in batch.decoder), default=0)
        n = len(steps)
        if n < 14:
            cost = 1.0 + 0.1 * drafts
        elif n < 22:
            cost = 1.0 if drafts <= 1 else 1.0 + drafts
        else:
            cost = 1.0 if drafts == 0 and all(w.kind is not DecoderKind.VERIFY for w in batch.decoder) else 10.0
        steps.append((engine.spec_control.draft_length, sum(w.kind is not DecoderKind.REPLAY for w in batch.decoder)))
        clock.advance(cost)
        return execute(batch)

    engine.runner.execute = timed
    return steps


@pytest.fixture(scope="module")
def long_plain(model):
    """Plain decoding's greedy tokens of ``LONG`` (the oracle of both cases below, computed once)."""
    return run(make(model, spec=0), LONG)


@pytest.mark.parametrize("broken", [False, True], ids=["exact", "broken-catch-up"])
def test_greedy_equal_while_the_controller_switches_draft_lengths(model, long_plain, broken, monkeypatch):
    """The goodput controller on a fake clock changes the draft length mid-request (0 -> 1 -> 2 -> 3 -> 1 -> 0,
    with the drafter's rings missing the plain steps' positions and sequences catching up after an odd
    rollback): the greedy tokens equal plain decoding's, with the integrity check after every step. Broken: at
    draft length 0 a sequence holding back an accepted token feeds only its last one, as plain decoding does;
    the integrity check (or the tokens) catch it."""
    from flashtier.engine.spec import schedule as spec_schedule

    want = long_plain
    clock = FakeClock()
    eng = make(model, adaptive=True, clock=clock)
    lengths = phased_cost(eng, clock)
    # drafts right up to a varying position; all wrong in the last 1-draft steps (from step 22 for c0, 23 for c1):
    # one known token and no draft accepted leave an odd kept length, so c1 holds a token back when the draft
    # length drops to 0 and catches up in the next step
    force_drafts(eng, want, wrong_from=lambda rid, done: 0 if len(lengths) >= 22 + int(rid[1:]) else
                 (done + int(rid[1:])) % 4)
    if broken:
        feed = spec_schedule.SpecPolicy.feed

        def plain_feed(self, req, seq, budget, cap=None):
            tokens, n = feed(self, req, seq, budget, cap)
            return ([seq.output[-1]], 0) if cap == 0 else (tokens, n)

        monkeypatch.setattr(spec_schedule.SpecPolicy, "feed", plain_feed)
        try:
            got = run(eng, LONG)
        except RuntimeError as e:
            assert "KV holds" in str(e)
            return
        assert got != want
        return
    assert run(eng, LONG) == want
    s = eng.stats()
    both = [k for k, n in lengths if n == 2]  # steps in which both requests decode
    switches = set(zip(both, both[1:]))
    assert {(0, 1), (1, 2), (2, 3)} <= switches, lengths  # on, and up to the depth
    assert any(a > b > 0 for a, b in switches) and any(a > 0 == b for a, b in switches), lengths  # down, and off
    assert eng.spec_control.buckets[2].choice == 0
    assert s.spec_steps_by_draft_length == tuple(sum(k == j for k, n in lengths if n) for j in range(DEPTH + 1))
    assert s.spec_accepted_tokens > 0
