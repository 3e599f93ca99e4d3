"""A sequence's block table: the pool block ids it owns, in token order, and their device tensor."""

from __future__ import annotations

import torch


class BlockTable:
    """The block ids a sequence owns, in token order (mutated only by the scheduler)."""

    def __init__(self, ids: list[int] | None = None, device: torch.device | str = "cpu"):
        self.ids: list[int] = list(ids or [])
        self.device = device
        self._tensor: torch.Tensor | None = None

    def append(self, block_id: int) -> None:
        self.ids.append(block_id)
        self._tensor = None

    def replace(self, ids: list[int]) -> None:
        self.ids = list(ids)
        self._tensor = None

    def tensor(self) -> torch.Tensor:
        if self._tensor is None:
            self._tensor = torch.tensor(self.ids, dtype=torch.long, device=self.device)
        return self._tensor

    def __len__(self) -> int:
        return len(self.ids)
