"""A sampling step's result (``SamplerOutput``) and its raw-model logprob fields (sampler step 1)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from flashtier.engine.sample.params import SamplingParams

__all__ = ["SamplerOutput", "with_logprobs"]


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
