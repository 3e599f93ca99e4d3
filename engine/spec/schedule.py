"""What a decoding sequence feeds in the next step: its known tokens, then the drafts worth verifying.

Confidence-scheduled verify length: the drafter's confidence head scores each draft (a logit of "this draft
is accepted"); draft i is verified only while the estimated probability that drafts 1..i are all accepted,
prod_{j <= i} sigmoid(c_j), stays at or above ``min_confidence``. Each verified draft costs a target row;
one that would most likely be rejected buys nothing. The count is then capped by the depth, the goodput
controller's draft length for the step (spec/controller.py), the step's token budget, ``max_tokens``, the
context length and the window (a chunk never overwrites its own ring slots).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flashtier.engine.core.request import Request, Sequence
from flashtier.engine.spec.state import known_tokens


@dataclass(frozen=True)
class SpecPolicy:
    """How many drafts a step verifies: at most ``depth``, scheduled by confidence."""

    depth: int
    min_confidence: float
    max_model_len: int
    window: int

    def __post_init__(self) -> None:
        if self.depth < 1:
            raise ValueError(f"depth must be >= 1, got {self.depth}")
        if not 0.0 <= self.min_confidence < 1.0:
            raise ValueError(f"min_confidence must be in [0, 1), got {self.min_confidence}")

    def verify_length(self, confidence: torch.Tensor | None, n_drafts: int) -> int:
        """Drafts worth verifying out of ``n_drafts`` with scores ``confidence`` (None: all, up to depth)."""
        n = min(n_drafts, self.depth)
        if confidence is None or self.min_confidence == 0.0:
            return n
        alive = torch.cumprod(torch.sigmoid(confidence[:n].double()), 0) >= self.min_confidence
        return int(alive.long().cumprod(0).sum())

    def feed(self, req: Request, seq: Sequence, budget: int, cap: int | None = None) -> tuple[list[int], int]:
        """(tokens to feed, how many of them are drafts) for a decoding sequence, at most ``cap`` drafts (None:
        the depth). Reads only."""
        known = known_tokens(req, seq)
        spec = seq.spec
        if spec is None:
            return known, 0
        total = len(req.prompt) + len(seq.output)
        drafts = spec.drafts_for(total - 1)
        k = self.verify_length(spec.confidence, len(drafts))
        k = min(k, self.depth if cap is None else cap, budget - len(known),
                req.params.max_tokens - len(seq.output) - 1, self.max_model_len - total - 1, self.window - len(known))
        return known + list(drafts[: max(k, 0)]), max(k, 0)
