"""Batched next-token sampling: penalties, greedy / temperature / top-k / top-p / min-p, logprobs.

One call samples one token for every row of a ``[B, V]`` logits tensor. Each row carries its
own ``SamplingParams``, token history and (for seeded requests) its own ``torch.Generator``;
the per-row settings become ``[B]`` tensors so every step runs as whole-batch tensor ops. The
only Python loop over rows draws the seeded rows' random numbers from their generators.

Order of operations for each row (vLLM v1's order, except where noted):

1. Raw logprobs. When any row asks for logprobs, ``log_softmax`` of the logits *as the model
   produced them* is taken first. This is vLLM's default ``logprobs_mode="raw_logprobs"``:
   the returned numbers describe the model's distribution, before min-tokens masking,
   penalties, temperature and truncation. So they don't change with the sampling settings, and
   a greedy request and a ``temperature=0.7, top_p=0.9`` request report the same logprob for
   the same token. (The probabilities the sampler actually drew from are not reported.)
2. Min tokens: while a row has generated fewer than ``min_tokens`` tokens, its stop token ids
   (and EOS, unless ``ignore_eos``) are set to ``-inf``.
3. Penalties, in this order: repetition (prompt + generated tokens: positive logits divided
   by the penalty, negative ones multiplied), frequency (generated tokens: minus
   ``count * penalty``), presence (generated tokens: minus ``penalty`` once).
3b. Grammar mask: when the caller passes a token bitmask (structured output), tokens a row's
   grammar does not allow get ``-inf`` (``apply_token_bitmask`` below), so every later step, greedy
   included, only sees allowed tokens. Logprobs stay the raw ones of step 1.
4. Greedy rows (``temperature < GREEDY_TEMPERATURE_EPS``) take the argmax of the penalised
   logits and skip everything below. They draw no random numbers.
5. Temperature: ``logits / temperature``.
6. Top-k: keep exactly the k highest logits. Ties are broken towards the lower token id by a
   stable sort.
7. Top-p: on the distribution left by top-k (renormalised), keep the shortest prefix of the
   sorted tokens whose mass reaches ``top_p``. The first token is always kept, and
   ``top_p == 1`` keeps everything.
8. Min-p: drop tokens whose probability is below ``min_p * p_max``. vLLM applies min-p before
   top-k/top-p. The two orders give the same result unless top-p and min-p are combined,
   because min-p and top-k both keep a prefix of the sorted tokens.
9. Sample with the exponential race (the Gumbel-max trick): ``argmax(p / E)`` with
   ``E ~ Exp(1)`` i.i.d. per token. Seeded rows draw ``E`` from their own generator (exactly
   ``V`` draws per sampled step). Unseeded rows share one draw from the device's default
   generator. There is no ``torch.multinomial`` and no device-to-host copy: the result stays a
   device tensor, and turning it into Python ints is the caller's job.

Batch invariance: every operation above is row-local. A seeded row's token therefore depends
only on its own logits, params, history and generator state, not on its batch neighbours or
its position in the batch (the tests check this).

Where each step lives: ``row`` (``SamplerRow``, ``generator_for``, host-to-device copies of per-row
settings and histories), ``processors`` (steps 2-3 and 6-8); this module holds the rest (``SamplerOutput``
and the step-1 logprob fields, the grammar mask of step 3b, the exponential race of step 9) and runs them
in order.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from flashtier.engine.sample.params import SamplingParams
from flashtier.engine.sample.processors import (
    apply_min_p,
    apply_min_tokens,
    apply_penalties,
    apply_top_k_top_p,
)
from flashtier.engine.sample.row import SamplerRow, generator_for, to_device

__all__ = [
    "Sampler", "SamplerOutput", "SamplerRow", "allowed_tokens", "apply_min_p", "apply_min_tokens",
    "apply_penalties", "apply_token_bitmask", "apply_top_k_top_p", "exponential_race", "generator_for",
    "with_logprobs",
]


class Sampler:
    """Samples one token per row. See the module docstring for the order of operations.

    ``eos_token_id`` is the model's end-of-sequence id, masked out by ``min_tokens`` (unless a
    row sets ``ignore_eos``). The sampler keeps no state between calls. The only things it
    advances are the rows' generators.
    """

    def __init__(self, eos_token_id: int | None = None) -> None:
        self.eos_token_id = eos_token_id

    @torch.no_grad()
    def __call__(self, logits: torch.Tensor, rows: Sequence[SamplerRow],
                 token_bitmask: torch.Tensor | None = None) -> SamplerOutput:
        """Sample a token for each row of ``logits`` ``[B, V]`` (any float dtype and device).

        ``logits`` is not modified, because the sampler works on a float32 copy. The generators
        of sampled (non-greedy) rows advance by ``V`` draws each. ``token_bitmask`` ``[B, ceil(V/32)]``
        int32 (host or device) restricts each row to its grammar's tokens (all ones = unrestricted).

        Raises:
            ValueError: when ``logits`` is not 2-D, when ``len(rows) != B``, or when a row's
                generator is on a different device type than ``logits``.
        """
        if logits.dim() != 2:
            raise ValueError(f"logits must be [batch, vocab], got shape {tuple(logits.shape)}")
        B, V = logits.shape
        if len(rows) != B:
            raise ValueError(f"got {len(rows)} sampler rows for {B} logits rows; pass one row per sequence")
        device = logits.device
        for i, row in enumerate(rows):
            if row.generator is not None and row.generator.device.type != device.type:
                raise ValueError(
                    f"row {i}: generator is on {row.generator.device}, logits on {device}; "
                    "create it with generator_for(params, logits.device)"
                )
        params = [row.params for row in rows]

        raw = logits.float()
        want_logprobs = any(p.logprobs is not None for p in params)
        raw_logprobs = raw.log_softmax(dim=-1) if want_logprobs else None

        x = raw.clone()
        apply_min_tokens(x, rows, self.eos_token_id)
        apply_penalties(x, rows)
        if token_bitmask is not None:
            apply_token_bitmask(x, token_bitmask)
        token_ids = self._choose(x, rows)

        if raw_logprobs is None:
            return SamplerOutput(token_ids=token_ids)
        return with_logprobs(token_ids, raw_logprobs, params)

    @staticmethod
    def _choose(x: torch.Tensor, rows: Sequence[SamplerRow]) -> torch.Tensor:
        """Steps 4-9 on the penalised logits ``x`` (mutated: scaled and masked). Returns ``[B]`` ids."""
        device = x.device
        params = [row.params for row in rows]
        greedy = [p.is_greedy for p in params]
        if all(greedy):
            return x.argmax(dim=-1)
        greedy_ids = x.argmax(dim=-1) if any(greedy) else None
        sampled = [not g for g in greedy]

        def per_row(values: list[float] | list[int], dtype: torch.dtype) -> torch.Tensor:
            return to_device(values, dtype, device)

        # Greedy rows get neutral settings: their sampled value is discarded but must not be NaN.
        live = [p for p, s in zip(params, sampled) if s]
        temperature = [p.temperature if s else 1.0 for p, s in zip(params, sampled)]
        x.div_(per_row(temperature, torch.float32)[:, None])
        top_k = top_p = None
        if any(p.top_k_enabled for p in live):
            k = [p.top_k if s and p.top_k_enabled else 0 for p, s in zip(params, sampled)]
            top_k = per_row(k, torch.int64)
        if any(p.top_p < 1.0 for p in live):
            top_p = per_row([p.top_p if s else 1.0 for p, s in zip(params, sampled)], torch.float32)
        apply_top_k_top_p(x, top_k, top_p)
        if any(p.min_p > 0.0 for p in live):
            min_p = [p.min_p if s else 0.0 for p, s in zip(params, sampled)]
            apply_min_p(x, per_row(min_p, torch.float32))
        token_ids = exponential_race(x.softmax(dim=-1), rows, sampled)
        if greedy_ids is not None:
            token_ids = torch.where(per_row(greedy, torch.bool), greedy_ids, token_ids)
        return token_ids


@dataclass(frozen=True)
class SamplerOutput:
    """A sampling step's result. Every tensor is on the logits' device and nothing is synced to the host.

    ``token_ids`` ``[B]`` int64: the sampled token of each row.

    The logprob fields are ``None`` unless some row has ``params.logprobs is not None``. When
    present they are computed for every row, but only rows that asked are meaningful. All values
    are raw-model logprobs (``flashtier.engine.sample.sampler`` docstring, step 1):

    ``logprobs`` ``[B]`` float32: logprob of the sampled token.
    ``ranks`` ``[B]`` int64: 1 + the number of tokens with a strictly higher logprob (vLLM's rank).
    ``top_logprob_ids`` / ``top_logprobs`` ``[B, K]``, with K the largest ``params.logprobs`` in
    the batch, are sorted by descending logprob. Row i's valid entries are its first
    ``rows[i].params.logprobs`` columns.
    """

    token_ids: torch.Tensor
    logprobs: torch.Tensor | None = None
    ranks: torch.Tensor | None = None
    top_logprob_ids: torch.Tensor | None = None
    top_logprobs: torch.Tensor | None = None


def with_logprobs(
    token_ids: torch.Tensor, raw_logprobs: torch.Tensor, params: Sequence[SamplingParams]
) -> SamplerOutput:
    """``token_ids`` ``[B]`` with their logprob, rank and the top-K alternatives from ``raw_logprobs`` ``[B, V]``.

    K is the largest ``params[i].logprobs`` of the batch.
    """
    chosen = raw_logprobs.gather(1, token_ids[:, None])
    ranks = (raw_logprobs > chosen).sum(dim=-1) + 1
    k = max(p.logprobs or 0 for p in params)
    top_vals, top_ids = raw_logprobs.topk(k, dim=-1, sorted=True)
    return SamplerOutput(
        token_ids=token_ids,
        logprobs=chosen.squeeze(1),
        ranks=ranks,
        top_logprob_ids=top_ids,
        top_logprobs=top_vals,
    )


def exponential_race(
    probs: torch.Tensor, rows: Sequence[SamplerRow], sampled: Sequence[bool]
) -> torch.Tensor:
    """``argmax(probs / E)`` per row, ``E ~ Exp(1)``. This draws a token from ``probs`` without a host sync.

    Rows with a generator draw their ``V`` exponentials from it. The other sampled rows share one
    draw from the default generator. Rows with ``sampled[i] == False`` draw nothing, and their
    result is meaningless.
    """
    noise = torch.empty_like(probs)
    if any(s and row.generator is None for row, s in zip(rows, sampled)):
        noise.exponential_()
    for i, (row, s) in enumerate(zip(rows, sampled)):
        if s and row.generator is not None:
            noise[i].exponential_(generator=row.generator)
    # Exp(1) can round to 0; 0/0 would give NaN, which argmax ranks above every number.
    noise.clamp_min_(torch.finfo(noise.dtype).tiny)
    return (probs / noise).argmax(dim=-1)


def allowed_tokens(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """``[B, vocab]`` bool: which tokens the packed ``bitmask`` allows."""
    shifts = torch.arange(32, device=bitmask.device, dtype=torch.int32)
    bits = (bitmask.to(torch.int32).unsqueeze(-1) >> shifts) & 1
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab].bool()


def apply_token_bitmask(x: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Mutates ``x`` ``[B, V]``: disallowed tokens -> ``-inf``. ``bitmask`` may live on the host."""
    B, V = x.shape
    if bitmask.shape[0] != B or bitmask.shape[1] * 32 < V:
        raise ValueError(f"bitmask {tuple(bitmask.shape)} does not cover logits {tuple(x.shape)}")
    allowed = allowed_tokens(bitmask.to(x.device, non_blocking=True), V)
    x.masked_fill_(~allowed, float("-inf"))
