"""Host -> device copies for the sampler: per-row settings and token histories, without a host sync."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from flashtier.engine.sample.row import TokenIds

__all__ = ["flat_history", "to_device"]


def to_device(data: Sequence[float] | Sequence[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Copy a small host list to ``device`` without blocking the host on the device's stream."""
    t = torch.tensor(data, dtype=dtype)
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def flat_history(
    histories: Sequence[TokenIds], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Concatenate per-row token ids: ``(ids [N], owning row [N])`` on ``device``, int64.

    Lists travel in one host-to-device copy. Tensors are used where they are (no copy when
    already on ``device``). Nothing waits on the device.
    """
    parts: list[torch.Tensor] = []
    owners: list[torch.Tensor] = []
    list_ids: list[int] = []
    list_rows: list[int] = []
    list_lens: list[int] = []
    for i, h in enumerate(histories):
        if isinstance(h, torch.Tensor):
            t = h.reshape(-1).to(dtype=torch.int64)
            if t.device != device:
                if device.type == "cuda" and t.device.type == "cpu":
                    t = t.pin_memory()
                t = t.to(device, non_blocking=True)
            parts.append(t)
            owners.append(torch.full((t.numel(),), i, dtype=torch.int64, device=device))
        elif len(h):
            list_ids.extend(h)
            list_rows.append(i)
            list_lens.append(len(h))
    if list_ids:
        parts.append(to_device(list_ids, torch.int64, device))
        owners.append(
            torch.repeat_interleave(
                to_device(list_rows, torch.int64, device),
                to_device(list_lens, torch.int64, device),
                output_size=len(list_ids),  # known on the host: no device sync
            )
        )
    if not parts:
        empty = torch.empty(0, dtype=torch.int64, device=device)
        return empty, empty
    return torch.cat(parts), torch.cat(owners)
