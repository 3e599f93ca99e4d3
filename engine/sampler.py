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
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .sampling_params import SamplingParams

__all__ = [
    "Sampler",
    "SamplerOutput",
    "SamplerRow",
    "apply_min_p",
    "apply_min_tokens",
    "apply_penalties",
    "apply_top_k_top_p",
    "generator_for",
]

TokenIds = Sequence[int] | torch.Tensor


@dataclass(frozen=True)
class SamplerRow:
    """One sequence's inputs to a sampling step.

    ``output_token_ids`` are the tokens this sequence has generated so far (frequency and
    presence penalties, min_tokens). ``prompt_token_ids`` are only read when
    ``params.repetition_penalty != 1``, since that penalty covers prompt and output tokens as
    in vLLM. Ids must lie in ``[0, V)``. ``generator`` should be on the logits' device, seeded
    from ``params.seed`` (see ``generator_for``), and kept by the caller for the whole request.
    The sampler advances it by exactly ``V`` exponential draws each time it samples the row
    (none when the row is greedy). ``None`` uses the device's default generator
    (not reproducible).

    Histories may be lists or int tensors. Lists are copied to the device on every call, so for
    long prompts with a repetition penalty the caller should keep ``prompt_token_ids`` as a
    device tensor. On an H200 with 64 rows, V = 129,280 and 3,000-token prompts, a step took
    18 ms with lists and 4 ms with device tensors.
    """

    params: SamplingParams
    output_token_ids: TokenIds = ()
    prompt_token_ids: TokenIds = ()
    generator: torch.Generator | None = None


@dataclass(frozen=True)
class SamplerOutput:
    """A sampling step's result. Every tensor is on the logits' device and nothing is synced to the host.

    ``token_ids`` ``[B]`` int64: the sampled token of each row.

    The logprob fields are ``None`` unless some row has ``params.logprobs is not None``. When
    present they are computed for every row, but only rows that asked are meaningful. All values
    are raw-model logprobs (module docstring, step 1):

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


def generator_for(params: SamplingParams, device: torch.device | str) -> torch.Generator | None:
    """A new generator on ``device`` seeded with ``params.seed``, or None for unseeded requests.

    Create one per sequence when the request arrives and pass the same object on every step.
    For ``n > 1`` with a seed, give each of the n sequences its own generator (for example,
    seeded ``seed + i``). Otherwise they would all sample the same tokens.
    """
    if params.seed is None:
        return None
    return torch.Generator(device=device).manual_seed(params.seed)


# ----------------------------------------------------------------------------- host -> device


def _to_device(data: Sequence[float] | Sequence[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Copy a small host list to ``device`` without blocking the host on the device's stream."""
    t = torch.tensor(data, dtype=dtype)
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def _flat_history(
    histories: Sequence[TokenIds], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Concatenate per-row token ids: ``(ids [N], owning row [N])`` on ``device``, int64.

    Lists travel in one host-to-device copy. Tensors are used where they are (no copy when
    already on ``device``). Nothing waits on the device.
    """
    parts: list[torch.Tensor] = []
    owners: list[torch.Tensor] = []
    list_ids: list[int] = []
    list_rows: list[int] = []
    list_lens: list[int] = []
    for i, h in enumerate(histories):
        if isinstance(h, torch.Tensor):
            t = h.reshape(-1).to(dtype=torch.int64)
            if t.device != device:
                if device.type == "cuda" and t.device.type == "cpu":
                    t = t.pin_memory()
                t = t.to(device, non_blocking=True)
            parts.append(t)
            owners.append(torch.full((t.numel(),), i, dtype=torch.int64, device=device))
        elif len(h):
            list_ids.extend(h)
            list_rows.append(i)
            list_lens.append(len(h))
    if list_ids:
        parts.append(_to_device(list_ids, torch.int64, device))
        owners.append(
            torch.repeat_interleave(
                _to_device(list_rows, torch.int64, device),
                _to_device(list_lens, torch.int64, device),
                output_size=len(list_ids),  # known on the host: no device sync
            )
        )
    if not parts:
        empty = torch.empty(0, dtype=torch.int64, device=device)
        return empty, empty
    return torch.cat(parts), torch.cat(owners)


# ----------------------------------------------------------------------------- processors


def apply_min_tokens(logits: torch.Tensor, rows: Sequence[SamplerRow], eos_token_id: int | None) -> torch.Tensor:
    """Set stop tokens to ``-inf`` in rows that have not yet generated ``min_tokens`` tokens.

    A row's stop tokens are its ``stop_token_ids`` plus ``eos_token_id`` unless ``ignore_eos``.
    Ids outside ``[0, V)`` are skipped because they cannot be sampled anyway.
    Mutates ``logits`` ``[B, V]`` in place and returns it.
    """
    vocab = logits.shape[-1]
    row_idx: list[int] = []
    tok_idx: list[int] = []
    for i, row in enumerate(rows):
        p = row.params
        if len(row.output_token_ids) >= p.min_tokens:
            continue
        stops = set(p.stop_token_ids)
        if eos_token_id is not None and not p.ignore_eos:
            stops.add(eos_token_id)
        for tok in sorted(t for t in stops if 0 <= t < vocab):
            row_idx.append(i)
            tok_idx.append(tok)
    if row_idx:
        r = _to_device(row_idx, torch.int64, logits.device)
        t = _to_device(tok_idx, torch.int64, logits.device)
        logits.index_put_((r, t), logits.new_full((len(row_idx),), float("-inf")))
    return logits


def apply_penalties(logits: torch.Tensor, rows: Sequence[SamplerRow]) -> torch.Tensor:
    """Apply repetition, then frequency, then presence penalties, row by row (vectorised).

    For row b and token v, with ``c`` = count of v in the row's generated tokens and ``seen`` =
    v occurs in the prompt or the generated tokens:

    * repetition ``r``: if seen, ``l = l / r`` when ``l > 0`` else ``l * r``;
    * frequency ``f``: ``l -= f * c``;
    * presence ``p``: ``l -= p * (c > 0)``.

    Rows whose penalties are all neutral are left bit-for-bit unchanged, and their histories
    are not read. Mutates ``logits`` ``[B, V]`` in place and returns it. Token ids outside
    ``[0, V)`` raise the indexing error of the device.
    """
    active = [row.params.has_penalties for row in rows]
    if not any(active):
        return logits
    B, V = logits.shape
    device = logits.device
    outputs = [row.output_token_ids if a else () for row, a in zip(rows, active)]
    ids, owner = _flat_history(outputs, device)
    counts = torch.zeros(B * V, dtype=logits.dtype, device=device)
    counts.index_add_(0, owner * V + ids, torch.ones_like(ids, dtype=logits.dtype))
    counts = counts.view(B, V)
    occurred = counts > 0

    if any(a and row.params.repetition_penalty != 1.0 for row, a in zip(rows, active)):
        prompts = [
            row.prompt_token_ids if a and row.params.repetition_penalty != 1.0 else ()
            for row, a in zip(rows, active)
        ]
        p_ids, p_owner = _flat_history(prompts, device)
        seen = occurred.clone().view(-1)
        seen.index_fill_(0, p_owner * V + p_ids, True)
        seen = seen.view(B, V)
        rep = _to_device([row.params.repetition_penalty for row in rows], logits.dtype, device)[:, None]
        scaled = torch.where(logits > 0, logits / rep, logits * rep)
        logits.copy_(torch.where(seen, scaled, logits))

    freq = _to_device([row.params.frequency_penalty for row in rows], logits.dtype, device)[:, None]
    pres = _to_device([row.params.presence_penalty for row in rows], logits.dtype, device)[:, None]
    logits.sub_(freq * counts)
    logits.sub_(pres * occurred.to(logits.dtype))
    return logits


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    """Mask to ``-inf`` the tokens outside each row's top-k, then outside its nucleus.

    ``top_k`` ``[B]`` int64 (``>= V`` or ``<= 0`` = off), ``top_p`` ``[B]`` float (``>= 1`` = off);
    either may be None for "off in every row". Top-k keeps exactly k tokens (stable sort: ties
    go to the lower id). Top-p renormalises what top-k left, then keeps the smallest sorted prefix
    whose mass reaches ``top_p``, always at least one token. Mutates ``logits`` ``[B, V]`` in
    place and returns it.
    """
    if top_k is None and top_p is None:
        return logits
    V = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True, stable=True)
    position = torch.arange(V, device=logits.device)
    remove = torch.zeros_like(sorted_logits, dtype=torch.bool)
    if top_k is not None:
        k = torch.where(top_k > 0, top_k, V)[:, None]
        remove |= position[None, :] >= k
        sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    if top_p is not None:
        probs = sorted_logits.softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        remove |= (mass_before >= top_p[:, None]) & (top_p[:, None] < 1.0)
    mask = torch.zeros_like(remove).scatter_(1, order, remove)
    return logits.masked_fill_(mask, float("-inf"))


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Mask to ``-inf`` tokens with probability below ``min_p * p_max`` (per row; 0 = off).

    ``min_p`` ``[B]`` float. Mutates ``logits`` ``[B, V]`` in place and returns it.
    """
    probs = logits.softmax(dim=-1)
    threshold = min_p[:, None] * probs.amax(dim=-1, keepdim=True)
    return logits.masked_fill_(probs < threshold, float("-inf"))


def _exponential_race(
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


# ----------------------------------------------------------------------------- sampler


class Sampler:
    """Samples one token per row. See the module docstring for the order of operations.

    ``eos_token_id`` is the model's end-of-sequence id, masked out by ``min_tokens`` (unless a
    row sets ``ignore_eos``). The sampler keeps no state between calls. The only things it
    advances are the rows' generators.
    """

    def __init__(self, eos_token_id: int | None = None) -> None:
        self.eos_token_id = eos_token_id

    @torch.no_grad()
    def __call__(self, logits: torch.Tensor, rows: Sequence[SamplerRow]) -> SamplerOutput:
        """Sample a token for each row of ``logits`` ``[B, V]`` (any float dtype and device).

        ``logits`` is not modified, because the sampler works on a float32 copy. The generators
        of sampled (non-greedy) rows advance by ``V`` draws each.

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
        token_ids = self._choose(x, rows)

        if raw_logprobs is None:
            return SamplerOutput(token_ids=token_ids)
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
            return _to_device(values, dtype, device)

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
        token_ids = _exponential_race(x.softmax(dim=-1), rows, sampled)
        if greedy_ids is not None:
            token_ids = torch.where(per_row(greedy, torch.bool), greedy_ids, token_ids)
        return token_ids
