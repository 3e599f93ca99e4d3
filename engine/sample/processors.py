"""Logit processors of the sampler: history-based (steps 2-3: min_tokens stop masking, then repetition /
presence / frequency penalties) and truncation masks (steps 6-8: top-k, then top-p, then min-p).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from flashtier.engine.sample.row import SamplerRow, flat_history, to_device

__all__ = ["apply_min_p", "apply_min_tokens", "apply_penalties", "apply_top_k_top_p"]


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
        r = to_device(row_idx, torch.int64, logits.device)
        t = to_device(tok_idx, torch.int64, logits.device)
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
    ids, owner = flat_history(outputs, device)
    counts = torch.zeros(B * V, dtype=logits.dtype, device=device)
    counts.index_add_(0, owner * V + ids, torch.ones_like(ids, dtype=logits.dtype))
    counts = counts.view(B, V)
    occurred = counts > 0

    if any(a and row.params.repetition_penalty != 1.0 for row, a in zip(rows, active)):
        prompts = [
            row.prompt_token_ids if a and row.params.repetition_penalty != 1.0 else ()
            for row, a in zip(rows, active)
        ]
        p_ids, p_owner = flat_history(prompts, device)
        seen = occurred.clone().view(-1)
        seen.index_fill_(0, p_owner * V + p_ids, True)
        seen = seen.view(B, V)
        rep = to_device([row.params.repetition_penalty for row in rows], logits.dtype, device)[:, None]
        scaled = torch.where(logits > 0, logits / rep, logits * rep)
        logits.copy_(torch.where(seen, scaled, logits))

    freq = to_device([row.params.frequency_penalty for row in rows], logits.dtype, device)[:, None]
    pres = to_device([row.params.presence_penalty for row in rows], logits.dtype, device)[:, None]
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
