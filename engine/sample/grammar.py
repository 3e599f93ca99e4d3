"""Sampler step 3b: the grammar mask. Tokens a row's grammar does not allow get ``-inf``.

``bitmask`` is xgrammar's layout: ``[B, ceil(V / 32)]`` int32, bit ``t % 32`` of word ``t // 32`` set
when token ``t`` is allowed; rows without a grammar are all ones (-1). The unpacking is whole-batch
tensor ops on the logits' device, so one constrained row costs the batch one masked fill, not a
host round trip.
"""

from __future__ import annotations

import torch

__all__ = ["allowed_tokens", "apply_token_bitmask"]


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
