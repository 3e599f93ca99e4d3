"""Counters of speculative decoding (monotonic; read by ``Engine.stats`` for /metrics and by the goodput
controller, spec/controller.py, for its acceptance estimate).

    drafts                 VERIFY works that verified at least one draft
    draft_tokens           drafts verified (a work with k drafts adds k)
    accepted_tokens        drafts accepted
    acceptance[k]          works that accepted exactly k drafts (k = 0 .. depth): the acceptance-length histogram
    verified_by_position   [j] works that verified draft j + 1 (at least j + 1 drafts), j = 0 .. depth - 1
    accepted_by_position   [j] works that accepted draft j + 1 (drafts 1 .. j + 1 all accepted)
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecStats:
    depth: int
    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    acceptance: list[int] = field(default_factory=list)
    verified_by_position: list[int] = field(default_factory=list)
    accepted_by_position: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.acceptance:
            self.acceptance = [0] * (self.depth + 1)
        if not self.verified_by_position:
            self.verified_by_position = [0] * self.depth
        if not self.accepted_by_position:
            self.accepted_by_position = [0] * self.depth

    def record(self, n_drafts: int, n_accepted: int) -> None:
        """One VERIFY work's outcome (works without drafts are not counted). Mutates the counters."""
        if n_drafts == 0:
            return
        if not 0 <= n_accepted <= n_drafts <= self.depth:
            raise ValueError(f"accepted {n_accepted} of {n_drafts} drafts (depth {self.depth})")
        self.drafts += 1
        self.draft_tokens += n_drafts
        self.accepted_tokens += n_accepted
        self.acceptance[n_accepted] += 1
        for j in range(n_drafts):
            self.verified_by_position[j] += 1
        for j in range(n_accepted):
            self.accepted_by_position[j] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0
