"""Per-request sampling parameters, with vLLM's names and defaults and validation at construction.

``SamplingParams`` is the engine's public boundary for a request's decoding settings: the server
maps OpenAI fields (``temperature``, ``top_p``, ``presence_penalty``, ``seed``, ``logprobs`` /
``top_logprobs``, ``max_tokens`` / ``max_completion_tokens``) and vLLM's extras (``top_k``,
``min_p``, ``repetition_penalty``, ``min_tokens``, ``stop_token_ids``, ``ignore_eos``) onto it.
Stop *strings* never reach the engine (it sees token ids only); the server matches them while
detokenizing.

Every field is checked in ``__post_init__``; a bad value raises ``ValueError`` whose message names
the field, the allowed range and the value received, so the server can return it as a 400.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

from flashtier.engine.grammar.constraint import OutputConstraint

# Temperatures below this are greedy (vLLM's ``_SAMPLING_EPS``): dividing logits by a tiny
# temperature overflows fp32, and the resulting distribution is an argmax anyway.
GREEDY_TEMPERATURE_EPS = 1e-5
MAX_LOGPROBS = 20  # OpenAI's top_logprobs cap, and vLLM's default --max-logprobs
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


def _check_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r} ({type(value).__name__})")
    return value


def _check_float(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {value!r} ({type(value).__name__})")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class SamplingParams:
    """How to choose each next token of one request (vLLM-compatible names and defaults).

    Fields:
        n: number of independent completions for the prompt (>= 1). The engine fans a request
            out into ``n`` sequences; the sampler sees each as its own row.
        temperature: >= 0. Below ``GREEDY_TEMPERATURE_EPS`` (in particular 0) decoding is greedy
            and top_k / top_p / min_p / seed have no effect.
        top_p: nucleus mass in (0, 1]; 1 keeps everything.
        top_k: keep the k most likely tokens; 0 or -1 turns it off.
        min_p: in [0, 1]; drop tokens whose probability is below ``min_p * p_max``; 0 turns it off.
        presence_penalty: in [-2, 2]; subtracted once from the logit of every token that occurs in
            the *generated* tokens so far.
        frequency_penalty: in [-2, 2]; subtracted ``count`` times from the logit of every token
            that occurs ``count`` times in the *generated* tokens so far.
        repetition_penalty: > 0; for tokens seen in the prompt *or* the generated tokens, positive
            logits are divided by it and negative logits multiplied by it; 1 turns it off.
        seed: int64 or None. With a seed, a request's samples depend only on its own logits,
            parameters, history and seed (not on which other requests share its batch).
        stop_token_ids: extra token ids that end the sequence (the stop token itself is
            returned, as vLLM does). Stored as a tuple.
        ignore_eos: keep generating past the model's EOS token (it is still sampled normally).
        max_tokens: >= 1, the most tokens to generate.
        min_tokens: in [0, max_tokens]; until this many tokens are generated, EOS (unless
            ``ignore_eos``) and ``stop_token_ids`` are masked out of the distribution.
        logprobs: None (no logprobs), or an int in [0, MAX_LOGPROBS]: return the sampled token's
            logprob plus this many top alternatives per generated token (0 = sampled only).
        constraint: a compiled grammar the output must match (structured output, forced tool
            calls), or None. It needs EOS to end a completed grammar, so it cannot be combined with
            ``ignore_eos`` or ``min_tokens``.

    Raises:
        ValueError: on any out-of-range or wrongly typed field, naming the field and its range.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = field(default=())
    ignore_eos: bool = False
    max_tokens: int = 16
    min_tokens: int = 0
    logprobs: int | None = None
    constraint: OutputConstraint | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if _check_int("n", self.n) < 1:
            raise ValueError(f"n must be at least 1, got {self.n}")
        if _check_float("temperature", self.temperature) < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0 < _check_float("top_p", self.top_p) <= 1:
            raise ValueError(f"top_p must be in (0, 1] (1 = off), got {self.top_p}")
        if _check_int("top_k", self.top_k) < -1:
            raise ValueError(f"top_k must be -1 or 0 (off) or a positive integer, got {self.top_k}")
        if not 0 <= _check_float("min_p", self.min_p) <= 1:
            raise ValueError(f"min_p must be in [0, 1] (0 = off), got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2 <= _check_float(name, value) <= 2:
                raise ValueError(f"{name} must be in [-2, 2] (0 = off), got {value}")
        if _check_float("repetition_penalty", self.repetition_penalty) <= 0:
            raise ValueError(
                f"repetition_penalty must be > 0 (1 = off), got {self.repetition_penalty}"
            )
        if self.seed is not None and not _INT64_MIN <= _check_int("seed", self.seed) <= _INT64_MAX:
            raise ValueError(f"seed must fit in a signed 64-bit integer, got {self.seed}")
        object.__setattr__(self, "stop_token_ids", self._normalise_stop_ids(self.stop_token_ids))
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        if _check_int("max_tokens", self.max_tokens) < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if not 0 <= _check_int("min_tokens", self.min_tokens) <= self.max_tokens:
            raise ValueError(
                f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}"
            )
        if self.logprobs is not None and not 0 <= _check_int("logprobs", self.logprobs) <= MAX_LOGPROBS:
            raise ValueError(
                f"logprobs must be None or in [0, {MAX_LOGPROBS}] (number of top alternatives), "
                f"got {self.logprobs}"
            )

        if self.constraint is not None and (self.ignore_eos or self.min_tokens):
            raise ValueError("ignore_eos and min_tokens cannot be combined with a structured-output constraint "
                             "(a completed grammar allows nothing but EOS)")

    @staticmethod
    def _normalise_stop_ids(ids: Iterable[int]) -> tuple[int, ...]:
        if isinstance(ids, (str, bytes)) or not isinstance(ids, Iterable):
            raise ValueError(f"stop_token_ids must be a sequence of token ids, got {ids!r}")
        out = tuple(ids)
        for tok in out:
            if isinstance(tok, bool) or not isinstance(tok, int) or tok < 0:
                raise ValueError(f"stop_token_ids must hold non-negative integers, got {tok!r}")
        return out

    @property
    def is_greedy(self) -> bool:
        """Whether decoding is argmax (temperature below ``GREEDY_TEMPERATURE_EPS``)."""
        return self.temperature < GREEDY_TEMPERATURE_EPS

    @property
    def top_k_enabled(self) -> bool:
        return self.top_k > 0

    @property
    def has_penalties(self) -> bool:
        """Whether any of the three penalties changes the logits."""
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )
