"""What the batched forward needs to know about one part (encoder or decoder) of a step, on the device.

A step's query rows are every sequence's new positions, back to back (seq A: a0 a1 a2 | seq B: b0 | ...).
``StepRows`` is built once per part on the host (engine/runner/step_metadata.py) with one copy to the device and is
read by every layer; no layer loops over sequences. Window keys are addressed as a ``[T, W]`` gather: column
j of row t is position ``pos[t] - W + 1 + j``, read from this step's rows when it is at or after the row's
chunk start, else from the sequence's ring slot in the arena (engine/kv/ring_arena.py)::

    row t (pos p):   j = 0 ........................... W-1
                     p-W+1 ......... chunk_start ...... p
                     [ ring: arena[l][ring_row] ][ step: records[step_row] ]
                     visible: j >= win_start (= W - win_count)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flashtier.engine.model.compressor import PartialGroup
from flashtier.engine.model.dense_entries import DenseWrites


@dataclass(frozen=True)
class EntryWrites:
    """The global entries one KV source gains in this step, and where they go in the pool.

    Ratio 2: entry g pools positions (2g, 2g+1); ``rows`` is the second token's row, ``partner`` the first's
    (-1: the first token came in an earlier step and waits in the sequence's partial group,
    ``partials[partial_idx]``). Ratio 1: one entry per row, ``partner`` unused.
    """

    rows: torch.Tensor  # [G] int64
    partner: torch.Tensor  # [G] int64
    partial_idx: torch.Tensor  # [G] int64 index into ``partials`` (0 where partner >= 0)
    entry_pos: torch.Tensor  # [G] int64 entry index * ratio: where its RoPE is applied
    block: torch.Tensor  # [G] int64 pool block id
    offset: torch.Tensor  # [G] int64 entry slot inside the block
    partials: tuple[PartialGroup, ...]  # groups waiting from earlier steps that this step completes
    new_partial_rows: torch.Tensor  # [P] int64 rows whose token opens a group still open after the step
    new_partial_pos: tuple[int, ...]  # their positions
    new_partial_seqs: tuple[int, ...]  # their batch index (one per sequence at most)
    consumed_seqs: tuple[int, ...]  # batch indices whose waiting group this step completes
    count_after: tuple[int, ...]  # per batch index: entries of the source once the step is done

    @property
    def empty(self) -> bool:
        return self.rows.numel() == 0


@dataclass(frozen=True)
class StepRows:
    """Query rows of one part of a step (module docstring). Every tensor is on the model's device."""

    positions: torch.Tensor  # [T] int64
    row_seq: torch.Tensor  # [T] int64 batch index of the row's sequence
    last_rows: torch.Tensor  # [B] int64 last row of each sequence
    block_table: torch.Tensor  # [T, max_blocks] int32: the row's sequence's block table (padded with 0)
    win_ring_row: torch.Tensor  # [T, W] int64 arena row of column j
    win_step_row: torch.Tensor  # [T, W] int64 step row of column j (clamped: read only where from_step)
    win_from_step: torch.Tensor  # [T, W] bool
    win_start: torch.Tensor  # [T] int32
    win_count: torch.Tensor  # [T] int32
    ring_src_rows: torch.Tensor  # [R] int64 rows stored into the rings after each layer (newest W per sequence)
    ring_dst_rows: torch.Tensor  # [R] int64 their arena rows
    ngram_tokens: torch.Tensor  # [T, n] int64 token ids at pos, pos-1, ..., pos-n+1 (-1 before position 0)
    # KV source layer -> entries this part writes (encoder part only); DenseWrites: a CUDA-graph decode step's
    writes: dict[int, EntryWrites] | dict[int, DenseWrites]
    ngram_tokens_host: torch.Tensor | None = None  # ngram_tokens on the host: the Engram prefetch reads it

    @property
    def num_rows(self) -> int:
        return self.positions.numel()
