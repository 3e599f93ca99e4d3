"""SamplingParams: vLLM defaults, normalisation and ValueError messages that name the field and range."""

import pytest

from flashtier.engine.sample.params import MAX_LOGPROBS, SamplingParams


def test_defaults_match_vllm():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p) == (1, 1.0, 1.0, 0, 0.0)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert (p.seed, p.stop_token_ids, p.ignore_eos) == (None, (), False)
    assert (p.max_tokens, p.min_tokens, p.logprobs) == (16, 0, None)
    assert not p.is_greedy and not p.top_k_enabled and not p.has_penalties


def test_frozen_and_hashable():
    p = SamplingParams(stop_token_ids=[5, 7])
    assert p.stop_token_ids == (5, 7)  # a list is stored as a tuple
    assert hash(p) == hash(SamplingParams(stop_token_ids=(5, 7)))
    with pytest.raises(AttributeError):
        p.temperature = 0.5  # type: ignore[misc]


@pytest.mark.parametrize(
    ("kwargs", "greedy", "top_k_on", "penalised"),
    [
        ({"temperature": 0}, True, False, False),
        ({"temperature": 1e-6}, True, False, False),
        ({"temperature": 1e-4}, False, False, False),
        ({"top_k": -1}, False, False, False),
        ({"top_k": 1}, False, True, False),
        ({"presence_penalty": -0.1}, False, False, True),
        ({"frequency_penalty": 2}, False, False, True),
        ({"repetition_penalty": 0.9}, False, False, True),
    ],
)
def test_derived_flags(kwargs, greedy, top_k_on, penalised):
    p = SamplingParams(**kwargs)
    assert (p.is_greedy, p.top_k_enabled, p.has_penalties) == (greedy, top_k_on, penalised)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"n": 4},
        {"temperature": 0.0},
        {"temperature": 2},  # ints are fine for float fields
        {"top_p": 1e-9},
        {"top_p": 1},
        {"top_k": -1},
        {"top_k": 100000},
        {"min_p": 0},
        {"min_p": 1.0},
        {"presence_penalty": -2.0, "frequency_penalty": 2.0},
        {"repetition_penalty": 1e-3},
        {"seed": 2**63 - 1},
        {"seed": -(2**63)},
        {"stop_token_ids": range(3)},
        {"max_tokens": 1},
        {"max_tokens": 5, "min_tokens": 5},
        {"logprobs": 0},
        {"logprobs": MAX_LOGPROBS},
    ],
)
def test_accepts_boundaries(kwargs):
    SamplingParams(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"n": 0}, r"n must be at least 1, got 0"),
        ({"n": 1.5}, r"n must be an integer"),
        ({"n": True}, r"n must be an integer"),
        ({"temperature": -0.1}, r"temperature must be >= 0"),
        ({"temperature": float("nan")}, r"temperature must be finite"),
        ({"temperature": float("inf")}, r"temperature must be finite"),
        ({"temperature": "hot"}, r"temperature must be a number"),
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
        ({"top_p": 1.01}, r"top_p must be in \(0, 1\]"),
        ({"top_k": -2}, r"top_k must be -1 or 0 \(off\) or a positive integer, got -2"),
        ({"top_k": 2.0}, r"top_k must be an integer"),
        ({"min_p": -0.01}, r"min_p must be in \[0, 1\]"),
        ({"min_p": 1.5}, r"min_p must be in \[0, 1\]"),
        ({"presence_penalty": 2.5}, r"presence_penalty must be in \[-2, 2\]"),
        ({"frequency_penalty": -2.01}, r"frequency_penalty must be in \[-2, 2\]"),
        ({"repetition_penalty": 0.0}, r"repetition_penalty must be > 0"),
        ({"repetition_penalty": -1.0}, r"repetition_penalty must be > 0"),
        ({"seed": 2**63}, r"seed must fit in a signed 64-bit integer"),
        ({"seed": "42"}, r"seed must be an integer"),
        ({"stop_token_ids": [1, -1]}, r"stop_token_ids must hold non-negative integers"),
        ({"stop_token_ids": [1, "2"]}, r"stop_token_ids must hold non-negative integers"),
        ({"stop_token_ids": 5}, r"stop_token_ids must be a sequence of token ids"),
        ({"stop_token_ids": "</s>"}, r"stop_token_ids must be a sequence of token ids"),
        ({"ignore_eos": 1}, r"ignore_eos must be a bool"),
        ({"max_tokens": 0}, r"max_tokens must be at least 1, got 0"),
        ({"max_tokens": None}, r"max_tokens must be an integer"),
        ({"min_tokens": -1}, r"min_tokens must be in \[0, max_tokens=16\], got -1"),
        ({"max_tokens": 4, "min_tokens": 5}, r"min_tokens must be in \[0, max_tokens=4\], got 5"),
        ({"logprobs": -1}, r"logprobs must be None or in \[0, 20\]"),
        ({"logprobs": 21}, r"logprobs must be None or in \[0, 20\]"),
        ({"logprobs": True}, r"logprobs must be an integer"),
    ],
)
def test_rejects_with_actionable_message(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)
