"""Which decoder rows of a step a speculative engine reads, shared by both forwards (runner, paged_runner).

The decoder part of a step is every decoder work's rows back to back (REPLAY: the replayed window, DECODE:
one row, VERIFY: the chunk). A plain engine reads the logits of each work's last row. A speculative engine
also reads the logits of every VERIFY row and the DSpark draft inputs (the block inputs of the target layers,
mean over the streams) of every decoder row::

    decoder rows     | replay r0 .. r15 | decode d0 | verify v0 v1 v2 v3 |
    logit rows       |             r15  |        d0 | v0 v1 v2 v3       |   logit_offsets  (0, 1, 2, 6)
    hidden rows      | r0 .............................. v3              |   hidden_offsets (0, 16, 17, 21)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from flashtier.engine.core.scheduler_output import DecoderKind, DecoderWork


@dataclass(frozen=True)
class DecoderRowPlan:
    logit_rows: torch.Tensor | None  # decoder rows whose logits are computed (None: each work's last row)
    logit_offsets: tuple[int, ...]  # work i's logits: rows [off[i], off[i + 1]) (empty: row i)
    hidden_offsets: tuple[int, ...]  # work i's decoder rows: [off[i], off[i + 1]) (empty: no capture)
    taps: tuple[int, ...]  # layers whose block inputs are captured

    def capture(self) -> dict[int, torch.Tensor | None] | None:
        """The dict the forward fills (layer -> [T, D]), or None when nothing is captured."""
        return {layer: None for layer in self.taps} if self.taps else None

    def hidden(self, capture: dict[int, torch.Tensor | None] | None) -> torch.Tensor | None:
        """Draft inputs [T, n_taps, D] of every decoder row, from the filled ``capture``."""
        return None if capture is None else torch.stack([capture[layer] for layer in self.taps], dim=1)


def plan_rows(works: Sequence[DecoderWork], counts: Sequence[int], taps: Sequence[int],
              device: torch.device) -> DecoderRowPlan:
    """The plan for decoder works ``works`` of ``counts`` rows each; ``taps`` empty: a plain engine."""
    if not taps:
        return DecoderRowPlan(None, (), (), ())
    rows: list[int] = []
    logit_off, hidden_off = [0], [0]
    for w, c in zip(works, counts):
        start = hidden_off[-1]
        rows.extend(range(start, start + c) if w.kind is DecoderKind.VERIFY else [start + c - 1])
        logit_off.append(len(rows))
        hidden_off.append(start + c)
    return DecoderRowPlan(torch.tensor(rows, dtype=torch.long, device=device), tuple(logit_off),
                          tuple(hidden_off), tuple(taps))
