"""History-based logit processors (sampler steps 2-3): min_tokens stop masking, then penalties."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from flashtier.engine.sample.row import SamplerRow
from flashtier.engine.sample.transfer import flat_history, to_device

__all__ = ["apply_min_tokens", "apply_penalties"]


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
