"""The draw (sampler step 9): the exponential race, Gumbel-max without ``torch.multinomial`` or a host sync."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from flashtier.engine.sample.row import SamplerRow

__all__ = ["exponential_race"]


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
