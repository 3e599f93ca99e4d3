"""Truncation masks for sampled rows (sampler steps 6-8): top-k, then top-p, then min-p."""

from __future__ import annotations

import torch

__all__ = ["apply_min_p", "apply_top_k_top_p"]


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
