"""A sequence's block table: the pool block ids it owns, in token order, and their device tensor."""

from __future__ import annotations

import numpy as np
import torch


class BlockTable:
    """The block ids a sequence owns, in token order (mutated only by the scheduler, through ``append`` and
    ``replace``: ``ids`` is read-only to everyone else).

    Beside the list it keeps the same ids as an int32 array (grown by doubling), so that a step's metadata
    copies a sequence's table with one memcpy (``array()``) instead of converting a Python list of up to
    16K ints (a 1M-token context) per sequence and step."""

    def __init__(self, ids: list[int] | None = None, device: torch.device | str = "cpu"):
        self.ids: list[int] = []
        self.device = device
        self._arr = np.zeros(16, dtype=np.int32)
        self._tensor: torch.Tensor | None = None
        self.replace(list(ids or []))

    def append(self, block_id: int) -> None:
        """Mutates: ids, the array (grown by doubling when full), the cached tensor (dropped)."""
        n = len(self.ids)
        if n == len(self._arr):
            self._arr = np.concatenate([self._arr, np.zeros_like(self._arr)])
        self._arr[n] = block_id
        self.ids.append(block_id)
        self._tensor = None

    def replace(self, ids: list[int]) -> None:
        """Mutates: ids, the array, the cached tensor (dropped)."""
        self.ids = list(ids)
        if len(self.ids) > len(self._arr):
            self._arr = np.zeros(max(16, 1 << (len(self.ids) - 1).bit_length()), dtype=np.int32)
        self._arr[: len(self.ids)] = self.ids
        self._tensor = None

    def array(self) -> np.ndarray:
        """The ids as a read-only int32 view, valid until the next mutation."""
        view = self._arr[: len(self.ids)]
        view.flags.writeable = False
        return view

    def tensor(self) -> torch.Tensor:
        if self._tensor is None:
            self._tensor = torch.from_numpy(self._arr[: len(self.ids)].astype(np.int64)).to(self.device)
        return self._tensor

    def __len__(self) -> int:
        return len(self.ids)
