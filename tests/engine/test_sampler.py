"""Sampler: exact penalty arithmetic, supports and frequencies of each truncation, seeds, batch
invariance, raw-model logprobs and min_tokens (the mask functions against a plain-Python reference:
test_sampler_masks.py).

Frequency checks use Pearson's chi-square over the kept tokens with the 99.9% quantile as the
bound: a correct sampler fails it with probability 1e-3 per check, and the fixed seeds keep the
suite deterministic. A wrong distribution (e.g. forgetting to renormalise, or the wrong
temperature) exceeds the bound by orders of magnitude at N = 20,000.
"""

import pytest
import torch

from flashtier.engine.sample import sampler as sampler_module
from flashtier.engine.sample.sampler import Sampler
from flashtier.engine.sample.processors import apply_min_p
from flashtier.engine.sample.processors import apply_penalties
from flashtier.engine.sample.row import ExtendedTokens, SamplerRow, generator_for
from flashtier.engine.sample.params import SamplingParams

N = 20_000
# chi-square 99.9% quantiles by degrees of freedom
CHI2_999 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32}


def _chi2(counts: torch.Tensor, expected: torch.Tensor) -> float:
    """Pearson's statistic of ``counts`` against probabilities ``expected`` (both over the support)."""
    n = counts.sum().item()
    e = expected.double() * n
    return float(((counts.double() - e) ** 2 / e).sum())


def _sample_counts(logits: torch.Tensor, params: SamplingParams, n: int = N, seed: int = 0) -> torch.Tensor:
    """Token counts from ``n`` independent unseeded rows sharing ``logits`` (one batched call)."""
    torch.manual_seed(seed)
    out = Sampler()(logits.expand(n, -1), [SamplerRow(params)] * n)
    return torch.bincount(out.token_ids, minlength=logits.shape[-1])


def _assert_distribution(counts: torch.Tensor, expected: torch.Tensor) -> None:
    """Zero counts outside ``expected``'s support, chi-square under the 99.9% bound inside it."""
    support = expected > 0
    assert counts[~support].sum() == 0, f"sampled outside the support: {counts.tolist()}"
    k = int(support.sum())
    if k > 1:
        stat = _chi2(counts[support], expected[support])
        assert stat < CHI2_999[k - 1], f"chi2={stat:.1f} (df={k - 1}) counts={counts.tolist()} p={expected.tolist()}"


def _renorm(p: torch.Tensor, keep: list[int]) -> torch.Tensor:
    out = torch.zeros_like(p)
    out[keep] = p[keep] / p[keep].sum()
    return out


# Probabilities stored in a shuffled token order, so "the best tokens" are not simply the lowest ids.
P4 = torch.tensor([0.15, 0.5, 0.1, 0.25], dtype=torch.float64)  # best: 1, 3, 0, 2
L6 = torch.tensor([0.5, -1.0, 2.0, 0.0, 1.0, -3.0], dtype=torch.float64)  # best: 2, 4, 0, 3, 1, 5

CASES = {
    # name: (logits, params, expected distribution)
    "temperature=1": (L6, SamplingParams(), L6.softmax(-1)),
    "temperature=0.5": (L6, SamplingParams(temperature=0.5), (L6 / 0.5).softmax(-1)),
    "temperature=2": (L6, SamplingParams(temperature=2.0), (L6 / 2).softmax(-1)),
    "top_k=2": (L6, SamplingParams(top_k=2), _renorm(L6.softmax(-1), [2, 4])),
    "top_k=3,T=2": (L6, SamplingParams(top_k=3, temperature=2.0), _renorm((L6 / 2).softmax(-1), [2, 4, 0])),
    # nucleus: sorted 0.5, 0.25 | 0.15, 0.1. Mass before the 3rd token is 0.75 >= 0.7.
    "top_p=0.7": (P4.log(), SamplingParams(top_p=0.7), _renorm(P4, [1, 3])),
    # mass before the 3rd is 0.75 < 0.8 (kept), before the 4th is 0.9 >= 0.8 (dropped)
    "top_p=0.8": (P4.log(), SamplingParams(top_p=0.8), _renorm(P4, [1, 3, 0])),
    "top_p=0.3": (P4.log(), SamplingParams(top_p=0.3), _renorm(P4, [1])),
    # min_p * p_max = 0.55 * 0.5 = 0.275: keeps only the best
    "min_p=0.55": (P4.log(), SamplingParams(min_p=0.55), _renorm(P4, [1])),
    # 0.35 * 0.5 = 0.175: drops 0.15 and 0.1, keeps 0.25
    "min_p=0.35": (P4.log(), SamplingParams(min_p=0.35), _renorm(P4, [1, 3])),
    # 0.25 * 0.5 = 0.125: drops only 0.1
    "min_p=0.25": (P4.log(), SamplingParams(min_p=0.25), _renorm(P4, [1, 3, 0])),
    # top-k 3 keeps {1, 3, 0}, renormalised to 0.556, 0.278, 0.167. Then top-p 0.6 keeps token 3
    # (mass before it 0.556 < 0.6) and drops token 0 (mass before it 0.833).
    "top_k=3,top_p=0.6": (P4.log(), SamplingParams(top_k=3, top_p=0.6), _renorm(P4, [1, 3])),
}


@pytest.mark.parametrize("name", list(CASES))
def test_support_and_frequencies(name):
    logits, params, expected = CASES[name]
    counts = _sample_counts(logits.float()[None], params)
    _assert_distribution(counts, expected)


def test_frequency_check_detects_wrong_temperature():
    """The tolerance is tight enough: samples at T=1 fail against the T=0.5 distribution."""
    counts = _sample_counts(L6.float()[None], SamplingParams(temperature=1.0))
    assert _chi2(counts, (L6 / 0.5).softmax(-1)) > 100 * CHI2_999[5]


def test_mixed_params_in_one_batch():
    """All cases interleaved in one call (per-row tensors): each row group keeps its own distribution."""
    names = list(CASES)
    per = 8000
    V = 6
    logits, rows, group = [], [], []
    for i in range(per):
        for g, name in enumerate(names):
            base, params, _ = CASES[name]
            logits.append(torch.nn.functional.pad(base.float(), (0, V - base.numel()), value=float("-inf")))
            rows.append(SamplerRow(params))
            group.append(g)
    greedy_row = torch.tensor([0.0, 3.0, 1.0, 2.0, -1.0, 0.5])
    logits.append(greedy_row)
    rows.append(SamplerRow(SamplingParams(temperature=0.0, top_k=1)))
    torch.manual_seed(1)
    out = Sampler()(torch.stack(logits), rows)
    assert out.token_ids[-1] == 1
    group_t = torch.tensor(group)
    for g, name in enumerate(names):
        expected = torch.nn.functional.pad(CASES[name][2], (0, V - CASES[name][2].numel()))
        counts = torch.bincount(out.token_ids[:-1][group_t == g], minlength=V)
        _assert_distribution(counts, expected)


# ----------------------------------------------------------------------------- greedy


def test_greedy_is_argmax_and_ignores_truncation_and_generator():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(16, 50, generator=g)
    gen = torch.Generator().manual_seed(3)
    state = gen.get_state()
    rows = [SamplerRow(SamplingParams(temperature=0.0, top_k=5, top_p=0.1, min_p=0.9, seed=3), generator=gen)] * 16
    out = Sampler()(logits, rows)
    assert torch.equal(out.token_ids, logits.argmax(-1))
    assert out.token_ids.dtype == torch.int64 and out.logprobs is None
    assert torch.equal(gen.get_state(), state)  # greedy rows draw nothing


def test_greedy_rows_among_sampled_rows():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(10, 30, generator=g)
    rows = [SamplerRow(SamplingParams(temperature=0.0 if i % 2 else 1.5, top_p=0.5)) for i in range(10)]
    out = Sampler()(logits, rows)
    assert torch.equal(out.token_ids[1::2], logits[1::2].argmax(-1))


def test_input_logits_not_modified_and_low_precision_accepted():
    logits = torch.randn(3, 20).bfloat16()
    before = logits.clone()
    rows = [SamplerRow(SamplingParams(top_k=3, min_p=0.1, presence_penalty=1.0, logprobs=2), [1, 2])] * 3
    out = Sampler()(logits, rows)
    assert torch.equal(logits, before)
    assert out.logprobs is not None and out.logprobs.dtype == torch.float32


# ----------------------------------------------------------------------------- penalties


BASE = [2.0, -1.0, 0.5, -0.5, 3.0, 0.0]
PROMPT = [0, 1]
OUTPUT = [2, 2, 3]  # token 2 twice, token 3 once


@pytest.mark.parametrize(
    ("params", "expected"),
    [
        # repetition 2 on prompt+output tokens {0,1,2,3}: positive / 2, negative * 2
        (SamplingParams(repetition_penalty=2.0), [1.0, -2.0, 0.25, -1.0, 3.0, 0.0]),
        # repetition < 1 rewards: positive / 0.5, negative * 0.5
        (SamplingParams(repetition_penalty=0.5), [4.0, -0.5, 1.0, -0.25, 3.0, 0.0]),
        # frequency 0.5 on output counts only (prompt tokens 0, 1 untouched): 0.5 - 2*0.5, -0.5 - 1*0.5
        (SamplingParams(frequency_penalty=0.5), [2.0, -1.0, -0.5, -1.0, 3.0, 0.0]),
        # presence 0.25 once per output token, regardless of count
        (SamplingParams(presence_penalty=0.25), [2.0, -1.0, 0.25, -0.75, 3.0, 0.0]),
        (SamplingParams(presence_penalty=-1.0), [2.0, -1.0, 1.5, 0.5, 3.0, 0.0]),
        # all three, in order repetition -> frequency -> presence:
        #   token 2: 0.5/2 = 0.25 -> 0.25 - 2*0.5 = -0.75 -> -0.75 - 0.25 = -1.0
        #   token 3: -0.5*2 = -1.0 -> -1.0 - 0.5 = -1.5 -> -1.5 - 0.25 = -1.75
        (
            SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25),
            [1.0, -2.0, -1.0, -1.75, 3.0, 0.0],
        ),
    ],
)
def test_penalties_exact(params, expected):
    neutral = SamplerRow(SamplingParams(), output_token_ids=OUTPUT, prompt_token_ids=PROMPT)
    rows = [neutral, SamplerRow(params, output_token_ids=OUTPUT, prompt_token_ids=PROMPT), neutral]
    logits = torch.tensor([BASE] * 3)
    apply_penalties(logits, rows)
    torch.testing.assert_close(logits[1], torch.tensor(expected), rtol=0, atol=1e-7)
    assert torch.equal(logits[0], torch.tensor(BASE)) and torch.equal(logits[2], torch.tensor(BASE))


def test_penalties_accept_tensor_histories():
    rows = [SamplerRow(SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25),
                       output_token_ids=torch.tensor(OUTPUT), prompt_token_ids=torch.tensor(PROMPT))]
    logits = torch.tensor([BASE])
    apply_penalties(logits, rows)
    torch.testing.assert_close(logits[0], torch.tensor([1.0, -2.0, -1.0, -1.75, 3.0, 0.0]), rtol=0, atol=1e-7)


def test_extended_tokens_read_as_the_concatenated_list():
    base, extra = [4, 1, 4], (2, 4)
    ext, want = ExtendedTokens(base, extra), base + list(extra)
    assert len(ext) == 5 and list(ext) == want and [ext[i] for i in range(-5, 5)] == [want[i] for i in range(-5, 5)]
    assert ext[1:4] == want[1:4] and ext.count(4) == 3 and 2 in ext
    with pytest.raises(IndexError):
        ext[5]
    assert len(ExtendedTokens([], ())) == 0 and list(ExtendedTokens([], (7,))) == [7]


def test_penalties_and_min_tokens_read_extended_histories_as_lists():
    """A verify step's histories (output + drafts, spec/verify.py) give the same logits as the built list."""
    params = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25, min_tokens=4)
    got, want = torch.tensor([BASE]), torch.tensor([BASE])
    apply_penalties(got, [SamplerRow(params, ExtendedTokens(OUTPUT[:1], OUTPUT[1:]), PROMPT)])
    apply_penalties(want, [SamplerRow(params, list(OUTPUT), PROMPT)])
    assert torch.equal(got, want) and not torch.equal(got, torch.tensor([BASE]))
    from flashtier.engine.sample.processors import apply_min_tokens
    short = SamplerRow(params, ExtendedTokens([], (1, 2)))  # 2 < min_tokens: the stop token is masked
    assert apply_min_tokens(torch.zeros(1, 6), [short], eos_token_id=3)[0, 3] == float("-inf")


def test_penalties_steer_greedy_choice():
    logits = torch.tensor([[0.0, 1.0, 5.0, 4.5]])
    rows = [SamplerRow(SamplingParams(temperature=0.0, frequency_penalty=0.3), output_token_ids=[2, 2])]
    assert Sampler()(logits, rows).token_ids.item() == 3  # 5 - 0.6 < 4.5
    rows = [SamplerRow(SamplingParams(temperature=0.0, repetition_penalty=1.2), prompt_token_ids=[2])]
    assert Sampler()(logits, rows).token_ids.item() == 3  # 5 / 1.2 < 4.5


# ----------------------------------------------------------------------------- min_tokens


@pytest.mark.parametrize(
    ("generated", "ignore_eos", "expected"),
    [
        (0, False, 2),  # eos (4) and stop id (3) masked: next best is 2
        (1, False, 2),
        (2, False, 4),  # min_tokens reached: eos wins again
        (0, True, 4),  # ignore_eos: eos is not a stop token, so it isn't masked
    ],
)
def test_min_tokens_masks_stop_tokens(generated, ignore_eos, expected):
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0, 4.0]])
    params = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[3, 999], ignore_eos=ignore_eos)
    if ignore_eos:
        logits = torch.tensor([[0.0, 1.0, 2.0, 5.0, 4.0]])  # stop id 3 masked, eos 4 allowed
    out = Sampler(eos_token_id=4)(logits, [SamplerRow(params, output_token_ids=[7] * generated)])
    assert out.token_ids.item() == expected


# ----------------------------------------------------------------------------- seeds, batch invariance


def _run_steps(position, neighbours, steps=12, V=512):
    """Decode ``steps`` tokens for the seeded target request placed at ``position`` among ``neighbours``.

    The target's logits come from their own generator (so they don't depend on the batch), the
    neighbours' logits from another. Returns the target's tokens and logprobs.
    """
    target = SamplingParams(temperature=0.8, top_k=50, top_p=0.9, min_p=0.02, presence_penalty=0.5,
                            repetition_penalty=1.1, seed=7, logprobs=2)
    target_gen = generator_for(target, "cpu")
    logit_gen = torch.Generator().manual_seed(100)
    other_gen = torch.Generator().manual_seed(200)
    prompt = [1, 2, 3]
    history: list[int] = []
    n_hist = [[] for _ in neighbours]
    n_gens = [generator_for(p, "cpu") for p in neighbours]
    sampler = Sampler(eos_token_id=0)
    tokens, logprobs = [], []
    for _ in range(steps):
        target_logits = torch.randn(V, generator=logit_gen) * 3
        others = torch.randn(len(neighbours), V, generator=other_gen) * 3
        rows = [SamplerRow(p, n_hist[i], prompt, n_gens[i]) for i, p in enumerate(neighbours)]
        rows.insert(position, SamplerRow(target, list(history), prompt, target_gen))
        batch = torch.cat([others[:position], target_logits[None], others[position:]])
        out = sampler(batch, rows)
        tok = out.token_ids[position].item()
        history.append(tok)
        tokens.append(tok)
        logprobs.append((out.logprobs[position].item(), out.top_logprob_ids[position, :2].tolist()))
        for i in range(len(neighbours)):
            n_hist[i].append(out.token_ids[i + (i >= position)].item())
    return tokens, logprobs


NEIGHBOURS = [
    SamplingParams(temperature=0.0),
    SamplingParams(),  # unseeded: draws from the default generator
    SamplingParams(seed=7),  # same seed, different generator object
    SamplingParams(temperature=1.3, top_k=5, seed=11, logprobs=5),
    SamplingParams(top_p=0.5, frequency_penalty=1.0),
    SamplingParams(min_p=0.2, repetition_penalty=1.5, seed=3),
    SamplingParams(temperature=0.3, presence_penalty=-1.0, min_tokens=4),
]


def test_seeded_request_is_batch_invariant():
    torch.manual_seed(5)
    alone = _run_steps(0, [])
    torch.manual_seed(6)  # unseeded neighbours draw different noise: must not matter
    in_batch = _run_steps(5, NEIGHBOURS)
    torch.manual_seed(7)
    first = _run_steps(0, NEIGHBOURS[::-1])
    assert alone == in_batch == first
    assert len(set(alone[0])) > 3  # actually sampling, not stuck on one token


def test_seed_reproduces_and_different_seeds_differ():
    logits = torch.randn(1, 1000, generator=torch.Generator().manual_seed(9))

    def run(seed):
        params = SamplingParams(seed=seed)
        gen = generator_for(params, "cpu")
        return [Sampler()(logits, [SamplerRow(params, generator=gen)]).token_ids.item() for _ in range(20)]

    assert run(1234) == run(1234)
    assert run(1234) != run(4321)
    assert generator_for(SamplingParams(), "cpu") is None


# ----------------------------------------------------------------------------- logprobs


def test_logprobs_are_raw_model_logprobs():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(6, 100, generator=g) * 2
    params = [
        SamplingParams(logprobs=0),
        SamplingParams(logprobs=3, temperature=0.5, top_k=10),
        SamplingParams(),  # no logprobs
        SamplingParams(logprobs=5, temperature=0.0, presence_penalty=2.0),
        SamplingParams(logprobs=1, top_p=0.3, repetition_penalty=1.7),
        SamplingParams(logprobs=5, min_p=0.5),
    ]
    rows = [SamplerRow(p, output_token_ids=[int(logits[i].argmax())]) for i, p in enumerate(params)]
    out = Sampler()(logits, rows)
    ref = logits.log_softmax(-1)
    assert out.logprobs is not None and out.ranks is not None
    assert out.top_logprobs is not None and out.top_logprob_ids is not None
    assert out.top_logprobs.shape == out.top_logprob_ids.shape == (6, 5)
    tok = out.token_ids
    torch.testing.assert_close(out.logprobs, ref.gather(1, tok[:, None]).squeeze(1), rtol=0, atol=0)
    expected_rank = (ref > ref.gather(1, tok[:, None])).sum(-1) + 1
    assert torch.equal(out.ranks, expected_rank)
    assert (out.top_logprobs[:, :-1] >= out.top_logprobs[:, 1:]).all()  # sorted, descending
    assert torch.equal(out.top_logprob_ids, ref.topk(5, dim=-1).indices)
    torch.testing.assert_close(out.top_logprobs, ref.gather(1, out.top_logprob_ids), rtol=0, atol=0)
    # the penalised greedy row chose something else than the raw argmax: its rank shows it
    assert out.ranks[3] > 1 and tok[3] != logits[3].argmax()


def test_no_logprobs_requested_returns_none():
    out = Sampler()(torch.randn(2, 10), [SamplerRow(SamplingParams())] * 2)
    assert out.logprobs is None and out.ranks is None and out.top_logprobs is None and out.top_logprob_ids is None


# ----------------------------------------------------------------------------- argument errors


def test_sampler_argument_errors():
    sampler = Sampler()
    with pytest.raises(ValueError, match=r"logits must be \[batch, vocab\]"):
        sampler(torch.randn(10), [SamplerRow(SamplingParams())])
    with pytest.raises(ValueError, match="got 1 sampler rows for 2 logits rows"):
        sampler(torch.randn(2, 10), [SamplerRow(SamplingParams())])
    gen = torch.Generator().manual_seed(0)
    with pytest.raises(ValueError, match="row 0: generator is on cpu, logits on meta"):
        sampler(torch.empty(1, 10, device="meta"), [SamplerRow(SamplingParams(seed=0), generator=gen)])


def test_sampler_module_keeps_its_public_names():
    """Callers import the whole sampling API from ``flashtier.engine.sample.sampler``; the split keeps that."""
    for name in sampler_module.__all__:
        assert hasattr(sampler_module, name), name
    assert sampler_module.SamplerRow is SamplerRow and sampler_module.apply_min_p is apply_min_p
