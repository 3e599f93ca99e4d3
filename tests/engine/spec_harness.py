"""What tests/engine/test_speculative*.py and test_spec_controller.py share: engines, a forced drafter, a fake
clock, state comparison, chi-square."""

from __future__ import annotations

from collections import Counter

import torch

from flashtier.engine.config import EngineConfig
from flashtier.engine.engine import Engine
from flashtier.engine.core.scheduler_output import DecoderKind
from flashtier.kvstore.config import KVStoreConfig

DEPTH = 3
GREEDY = dict(temperature=0, max_tokens=6, ignore_eos=True)


def make(model, *, spec=DEPTH, forward="batched", budget=96, blocks=400, block_size=8, max_seqs=64,
         adaptive=False, clock=None):
    """A float64 engine; ``adaptive`` False verifies up to ``spec`` drafts in every step (the mechanics under
    test), True lets the goodput controller choose, on ``clock`` (a FakeClock: deterministic)."""
    cfg = EngineConfig(max_num_batched_tokens=budget, max_num_seqs=max_seqs, forward=forward, dtype="float64",
                       speculative_tokens=spec, speculative_adaptive=adaptive)
    kv = KVStoreConfig(block_size=block_size, num_blocks=blocks)
    return Engine(model, cfg, kv) if clock is None else Engine(model, cfg, kv, clock=clock)


def run(engine, requests, on_step=None, choices=None):
    """Step to completion with the integrity check after every step; tokens per (id, choice). ``choices``: a
    list that gets every ChoiceDelta with its request id."""
    for rid, prompt, params in requests:
        engine.add_request(rid, prompt, params)
    out: dict[tuple[str, int], list[int]] = {}
    while engine.has_unfinished():
        for o in engine.step():
            for c in o.choices:
                out.setdefault((o.request_id, c.index), []).extend(c.token_ids)
                if choices is not None:
                    choices.append((o.request_id, c))
        engine.check_integrity()
        if on_step:
            on_step(engine)
    assert engine.pool.num_used == 0, "a finished request still holds blocks"
    return out


def force_drafts(engine, want, wrong_from=lambda rid, done: (done + int(rid[1:])) % (DEPTH + 1)):
    """Replace the drafter's proposals by the plain run's continuation, wrong from ``wrong_from`` on."""
    block = engine.model.cfg.dspark_block_size

    def propose(live, n):
        for req, seq in live:
            done = len(seq.output)
            drafts = (want.get((req.request_id, seq.index), [])[done:] + [7] * block)[:block]
            for k in range(wrong_from(req.request_id, done), block):
                drafts[k] = 3 + (drafts[k] + 1) % 1000
            spec = seq.spec
            spec.drafts, spec.draft_pos = tuple(drafts), len(req.prompt) + done - 1
            spec.q = spec.confidence = None

    engine.drafter.propose = propose


class FakeClock:
    """Seconds that move only when a test advances them."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def plain_quarter(engine):
    """Every fourth request decodes without speculation (its steps mix VERIFY and DECODE work)."""
    engine.drafter.eligible = lambda req, seq: int(req.request_id[1:]) % 4 != 0


def watch_steps(engine) -> list[tuple[set[DecoderKind], bool]]:
    """Record each step's decoder kinds and whether it fed a prefill chunk (wraps the scheduler)."""
    steps = []
    schedule = engine.scheduler.schedule

    def wrapped():
        out = schedule()
        steps.append(({w.kind for w in out.decoder}, any(not w.seq.output for w in out.encoder)))
        return out

    engine.scheduler.schedule = wrapped
    return steps


def kv_state(seq):
    kv = seq.kv
    st = kv.private_state()
    entries = {src: (s.main_rows(torch.arange(s.count)), s.index_keys(s.count)) for src, s in kv.stores.items()}
    return st, entries


def same_state(a, b):
    (sa, ea), (sb, eb) = a, b
    assert sa.tokens == sb.tokens and sa.counts == sb.counts
    assert (sa.enc_start, sa.dec_start, sa.write_from) == (sb.enc_start, sb.dec_start, sb.write_from)
    assert torch.equal(sa.rings_pos, sb.rings_pos) and torch.equal(sa.rings_data, sb.rings_data)
    for src, ga in sa.partial.items():
        gb = sb.partial[src]
        assert (ga is None) == (gb is None), src
        if ga is not None:
            assert ga.position == gb.position and torch.allclose(ga.kv, gb.kv, rtol=1e-12, atol=0)
    assert torch.allclose(sa.tail_x, sb.tail_x, rtol=1e-12, atol=1e-300)
    assert torch.equal(sa.tail_pre, sb.tail_pre) or torch.allclose(sa.tail_pre, sb.tail_pre, rtol=1e-12)
    for src, (main, index) in ea.items():
        assert torch.equal(main, eb[src][0]) and torch.equal(index, eb[src][1]), src


def chi2_sf(stat: float, df: int) -> float:
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), torch.tensor(stat / 2)))


def two_sample_p(a: Counter, b: Counter) -> float:
    """p-value of a chi-square test that two samples of categories come from one distribution."""
    cats = sorted(set(a) | set(b))
    na, nb = sum(a.values()), sum(b.values())
    stat = 0.0
    for c in cats:
        tot = a[c] + b[c]
        for n, obs in ((na, a[c]), (nb, b[c])):
            exp = tot * n / (na + nb)
            stat += (obs - exp) ** 2 / exp
    return chi2_sf(stat, max(len(cats) - 1, 1))


