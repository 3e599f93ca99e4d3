"""The engine against the incremental path and the oracle (float64 mode; tolerance 1e-4 on logits).

After every step of every test the engine's integrity check runs (block pool invariants, ref counts
vs block tables, nothing held by a finished request).
"""

import random

import pytest
import torch

from flashtier.engine.config import EngineConfig
from flashtier.engine.engine import Engine
from flashtier.engine.model.incremental import IncrementalModel, greedy_generate
from flashtier.engine.model.reference import Plan, reference_forward
from flashtier.engine.sample.sampler import Sampler, SamplerRow
from flashtier.engine.sample.params import SamplingParams
from flashtier.kvstore.config import KVStoreConfig

from .conftest import random_prompt


def make_engine(model, *, budget=512, blocks=400, block_size=16, max_seqs=64):
    return Engine(model, EngineConfig(max_num_batched_tokens=budget, max_num_seqs=max_seqs),
                  KVStoreConfig(block_size=block_size, num_blocks=blocks))


def run(engine, requests, on_step=None):
    """Submit (id, prompt, params) triples, step to completion; tokens per (id, choice)."""
    for rid, prompt, params in requests:
        engine.add_request(rid, prompt, params)
    out: dict[tuple[str, int], list[int]] = {}
    steps = 0
    while engine.has_unfinished():
        for o in engine.step():
            for c in o.choices:
                out.setdefault((o.request_id, c.index), []).extend(c.token_ids)
        engine.check_integrity()
        steps += 1
        if on_step:
            on_step(engine, steps)
    assert engine.pool.num_used == 0, "a finished request still holds blocks"
    return out


def test_engine_greedy_equals_incremental_and_oracle(tiny64, tiny_cfg):
    prompt = random_prompt(90, seed=31)
    eng = make_engine(tiny64)
    got = run(eng, [("a", prompt, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))])[("a", 0)]
    want, _ = greedy_generate(IncrementalModel(tiny64), prompt, 30)
    assert got == want
    seq = torch.tensor(prompt + got[:-1])
    ref = reference_forward(tiny64, seq, Plan.ced(len(prompt), seq.numel(), tiny_cfg.sliding_window)).logits
    assert torch.argmax(ref, -1).tolist() == got


def test_batch_invariance_16_requests(tiny64, tiny_cfg):
    lengths = [3, 17, 40, 64, 5, 120, 33, 16, 90, 71, 8, 150, 49, 25, 100, 60]
    reqs = []
    for i, n in enumerate(lengths):
        params = (SamplingParams(temperature=0, max_tokens=6, ignore_eos=True) if i % 2 == 0 else
                  SamplingParams(temperature=0.9, top_p=0.95, seed=100 + i, max_tokens=6, ignore_eos=True))
        reqs.append((f"r{i}", random_prompt(n, seed=400 + i), params))
    together = run(make_engine(tiny64, budget=256), reqs)
    for rid, prompt, params in reqs:
        alone = run(make_engine(tiny64, budget=256), [(rid, prompt, params)])
        assert together[(rid, 0)] == alone[(rid, 0)], rid
    # and both equal the oracle: greedy by argmax, seeded by the same sampler on the oracle's logits
    w = tiny_cfg.sliding_window
    for rid, prompt, params in reqs[:6]:
        toks = together[(rid, 0)]
        seq = torch.tensor(prompt + toks[:-1])
        ref = reference_forward(tiny64, seq, Plan.ced(len(prompt), seq.numel(), w)).logits
        if params.seed is None:
            assert torch.argmax(ref, -1).tolist() == toks, rid
        else:
            gen = torch.Generator().manual_seed(params.seed)
            sampler, replay = Sampler(eos_token_id=tiny_cfg.eos_token_id), []
            for row in ref:
                out = sampler(row[None], [SamplerRow(params, list(replay), prompt, gen)])
                replay.append(int(out.token_ids[0]))
            assert replay == toks, rid


@pytest.mark.slow
def test_chunked_prefill_of_a_long_prompt_equals_unchunked(tiny64):
    # 7 chunks of 11 blocks (the last one ragged). Top-k and the candidate pool bite from ~64 tokens on and the
    # positions pass original_seq_len * rope_factor (1024) of the tiny preset, so 1200 tokens take every path
    # that the 2600 of earlier versions took, at a quarter of the CPU (the unchunked run's temporaries grow as n^2)
    prompt = random_prompt(1200, seed=32)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    chunked = run(make_engine(tiny64, budget=176, blocks=400), [("c", prompt, params)])
    whole = run(make_engine(tiny64, budget=1200, blocks=400), [("c", prompt, params)])
    assert chunked[("c", 0)] and len(chunked[("c", 0)]) == 4
    assert chunked == whole


def test_preemption_under_a_small_pool_gives_the_same_tokens(tiny64):
    reqs = [(f"p{i}", random_prompt(40 + 13 * i, seed=500 + i),
             SamplingParams(temperature=0, max_tokens=28, ignore_eos=True)) for i in range(6)]
    baseline = run(make_engine(tiny64, blocks=200), reqs)
    small = make_engine(tiny64, blocks=30)  # 29 usable blocks of 16 tokens; together they need ~40
    got = run(small, reqs)
    assert small.stats().preemptions > 0
    assert got == baseline


def test_shared_prefix_computes_only_uncached_tokens_and_matches_plan_c(tiny64, tiny_cfg):
    w = tiny_cfg.sliding_window
    prefix = random_prompt(1000, seed=33)
    first = prefix + random_prompt(30, seed=34)
    second = prefix + random_prompt(50, seed=35)
    eng = make_engine(tiny64, block_size=64, blocks=100)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    run(eng, [("first", first, params)])
    outs = []
    eng.add_request("second", second, params)
    while eng.has_unfinished():
        outs += [o for o in eng.step() if o.request_id == "second"]
        eng.check_integrity()
    toks = [t for o in outs for c in o.choices for t in c.token_ids]
    cache = outs[-1].cache
    r = 1000 // 64 * 64  # 960: the full blocks of the shared prefix
    assert cache.cached_tokens == r
    assert cache.computed_tokens == len(second) - (r - w)  # encoder replay of W tokens + the suffix
    assert eng.stats().prefix_hits_tokens == r
    seq = torch.tensor(second + toks[:-1])
    ref = reference_forward(tiny64, seq, Plan.resume(r, len(second), seq.numel(), w)).logits
    assert torch.argmax(ref, -1).tolist() == toks


def test_random_aborts_leak_nothing(tiny64):
    rng = random.Random(7)
    eng = make_engine(tiny64, budget=64, blocks=80)
    live = []
    for i in range(12):
        rid = f"x{i}"
        eng.add_request(rid, random_prompt(rng.randint(1, 120), seed=600 + i),
                        SamplingParams(temperature=0.7, seed=i, max_tokens=rng.randint(1, 30), n=rng.choice([1, 2])))
        live.append(rid)
    steps = 0
    while eng.has_unfinished():
        if live and rng.random() < 0.3:
            eng.abort(live.pop(rng.randrange(len(live))))
        eng.step()
        eng.check_integrity()
        steps += 1
    assert eng.pool.num_used == 0 and steps > 0


def test_n_choices_share_the_prompt_blocks(tiny64):
    eng = make_engine(tiny64, block_size=16)
    prompt = random_prompt(70, seed=36)
    eng.add_request("n3", prompt, SamplingParams(temperature=1.0, seed=5, max_tokens=10, n=3, ignore_eos=True))
    shared_seen = False
    out: dict[int, list[int]] = {}
    while eng.has_unfinished():
        for o in eng.step():
            for c in o.choices:
                out.setdefault(c.index, []).extend(c.token_ids)
        req = eng.requests.get("n3")
        if req and len(req.seqs) == 3:
            tables = [s.kv.table.ids for s in req.seqs]
            shared_seen |= tables[0][:4] == tables[1][:4] == tables[2][:4]
            assert eng.pool.blocks[tables[0][0]].ref_cnt == 3
        eng.check_integrity()
    assert shared_seen and sorted(out) == [0, 1, 2]
    assert len({tuple(v) for v in out.values()}) > 1  # different seeds per choice


def test_bad_requests_are_value_errors(tiny64):
    eng = make_engine(tiny64)
    with pytest.raises(ValueError, match="at least one token"):
        eng.add_request("e", [], SamplingParams())
    with pytest.raises(ValueError, match="token ids"):
        eng.add_request("e", [10**9], SamplingParams())
    with pytest.raises(ValueError, match="context length"):
        eng.add_request("e", [5] * 10, SamplingParams(max_tokens=10**7))


def test_repetition_penalty_reads_the_prompt_kept_on_the_device(tiny64, monkeypatch):
    """With a repetition penalty the sampler reads each request's prompt as one tensor kept for the request
    (``Request.penalty_prompt``), not a list copied every step; the tokens equal those from the list."""
    from flashtier.engine.core.request import Request

    on = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, repetition_penalty=2.0)
    off = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    prompt = random_prompt(40, seed=41)
    req = Request("x", prompt, on)
    kept = req.penalty_prompt(torch.device("cpu"))
    assert isinstance(kept, torch.Tensor) and kept.tolist() == prompt
    assert req.penalty_prompt(torch.device("cpu")) is kept  # copied once
    assert isinstance(Request("y", prompt, off).penalty_prompt(torch.device("cpu")), list)  # not read
    seen = []
    call = Sampler.__call__

    def spy(self, logits, rows, **kw):
        seen.extend(type(r.prompt_token_ids) for r in rows)
        return call(self, logits, rows, **kw)

    monkeypatch.setattr(Sampler, "__call__", spy)
    got = run(make_engine(tiny64), [("a", prompt, on)])[("a", 0)]
    assert len(seen) == 16 and set(seen) == {torch.Tensor}  # every step: the kept tensor
    monkeypatch.setattr(Request, "penalty_prompt", lambda self, device: self.prompt)  # the list, every step
    assert run(make_engine(tiny64), [("a", prompt, on)])[("a", 0)] == got
