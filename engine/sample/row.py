"""A sampling step's per-sequence input (``SamplerRow``) and the per-request generator it carries."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from flashtier.engine.sample.params import SamplingParams

__all__ = ["SamplerRow", "TokenIds", "generator_for"]

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


def generator_for(params: SamplingParams, device: torch.device | str) -> torch.Generator | None:
    """A new generator on ``device`` seeded with ``params.seed``, or None for unseeded requests.

    Create one per sequence when the request arrives and pass the same object on every step.
    For ``n > 1`` with a seed, give each of the n sequences its own generator (for example,
    seeded ``seed + i``). Otherwise they would all sample the same tokens.
    """
    if params.seed is None:
        return None
    return torch.Generator(device=device).manual_seed(params.seed)
