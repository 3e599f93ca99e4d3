"""A running sequence's KV in the paged runtime pool: global entries by block table, window rings as bytes.

``PagedEntries`` is one KV source's entries for one sequence (the ``GlobalEntries`` interface of the
model code): entry j of a stream with e entries per block lives in ``table[j // e]`` at ``j % e``;
writes quantise the raw values to the stored format (FP4 + e4m3 main KV, MXFP4 index K) and reads
dequantise them, so every reader sees exactly what the oracle computes.

``PagedSequence`` is the ``SequenceKV`` of one sequence: block table, per-stream entries, window rings
(FP8 + ue8m0 records, 528 B per slot in the real geometry), ratio-2 partial groups and the encoder
outputs of the newest ``window`` tokens (the decoder replay input).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch

from flashtier.kernels.quant_fp4 import dequantize_fp4, pack_fp4_record, quantize_fp4, unpack_fp4_record
from flashtier.kernels.quant_fp8 import dequantize_fp8, pack_fp8_record, quantize_fp8, unpack_fp8_record
from flashtier.kernels.quant_mxfp4 import (
    dequantize_mxfp4,
    pack_mxfp4_record,
    quantize_mxfp4,
    unpack_mxfp4_record,
)
from flashtier.kvstore.kv_pool import GlobalKVPool

from .model.compressor import PartialGroup
from .model.layer_forward import LocalKeys


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


class PagedEntries:
    """One KV source's global entries of one sequence, stored in the paged pool."""

    def __init__(
        self, pool: GlobalKVPool, stream: int, per_block: int, table: BlockTable, head_dim: int, index_dim: int,
        dtype: torch.dtype,
    ):
        self.pool, self.stream, self.per_block, self.table = pool, stream, per_block, table
        self.head_dim, self.index_dim, self.dtype = head_dim, index_dim, dtype
        self.count = 0

    def _where(self, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        table = self.table.tensor().to(idx.device)
        return table[torch.div(idx, self.per_block, rounding_mode="floor")], idx % self.per_block

    def index_keys(self, n: int) -> torch.Tensor:
        blocks, offs = self._where(torch.arange(n, device=self.pool.data.device))
        codes, scales = unpack_mxfp4_record(self.pool.read_index(self.stream, blocks, offs), self.index_dim)
        return dequantize_mxfp4(codes, scales).to(self.dtype)

    def main_rows(self, idx: torch.Tensor) -> torch.Tensor:
        blocks, offs = self._where(idx)
        codes, scales = unpack_fp4_record(self.pool.read_main(self.stream, blocks, offs), self.head_dim)
        return dequantize_fp4(codes, scales).to(self.dtype)

    def write(self, entries: torch.Tensor, main_raw: torch.Tensor, index_raw: torch.Tensor) -> None:
        """Quantise and store entries ``entries`` [G] (consecutive, starting at or below ``count``).

        The blocks must already be in the table (the scheduler allocates before the step).
        """
        if entries.numel() == 0:
            return
        first, last = int(entries[0]), int(entries[-1])
        assert first <= self.count and last - first + 1 == entries.numel(), "entries must be appended in order"
        assert last // self.per_block < len(self.table), "block not allocated before the write"
        blocks, offs = self._where(entries.to(self.pool.data.device))
        main = pack_fp4_record(*quantize_fp4(main_raw.float()))
        index = pack_mxfp4_record(*quantize_mxfp4(index_raw.float()))
        self.pool.write(self.stream, blocks, offs, main, index)
        self.count = max(self.count, last + 1)


class WindowRings:
    """Every layer's window ring of one sequence: FP8 records [L, W, hd + hd/32] and positions [L, W]."""

    def __init__(self, n_layers: int, window: int, head_dim: int, dtype: torch.dtype, device: torch.device | str):
        self.head_dim, self.dtype, self.window = head_dim, dtype, window
        self.data = torch.zeros(n_layers, window, head_dim + head_dim // 32, dtype=torch.uint8, device=device)
        self.pos = torch.full((n_layers, window), -1, dtype=torch.long, device=device)

    def keys(self, layer: int, start: int) -> LocalKeys:
        codes, scales = unpack_fp8_record(self.data[layer], self.head_dim)
        return LocalKeys(dequantize_fp8(codes, scales).to(self.dtype), self.pos[layer], start)

    def write(self, layer: int, kv_raw: torch.Tensor, pos: torch.Tensor) -> None:
        kv_raw, pos = kv_raw[-self.window :], pos[-self.window :]
        slots = pos % self.window
        self.data[layer, slots] = pack_fp8_record(*quantize_fp8(kv_raw.float()))
        self.pos[layer, slots] = pos

    def clear(self, layers: range) -> None:
        self.pos[layers.start : layers.stop] = -1

    def nbytes(self) -> int:
        return self.data.numel()


@dataclass
class PagedSequence:
    """One sequence's KV state in the engine (implements the model's ``SequenceKV``)."""

    table: BlockTable
    stores: dict[int, PagedEntries]
    rings: WindowRings
    partial: dict[int, PartialGroup | None]
    tokens: list[int] = field(default_factory=list)
    enc_start: int = 0
    dec_start: int = 0
    write_from: int = 0
    tail_x: torch.Tensor | None = None
    tail_pre: torch.Tensor | None = None

    def ring_keys(self, layer: int, start: int) -> LocalKeys:
        return self.rings.keys(layer, start)

    def ring_write(self, layer: int, kv_raw: torch.Tensor, pos: torch.Tensor) -> None:
        self.rings.write(layer, kv_raw, pos)

    def private_state(self) -> dict:
        """Everything but the global blocks, copied (for preemption swap-out and forks)."""
        return {
            "rings_data": self.rings.data.clone(),
            "rings_pos": self.rings.pos.clone(),
            "partial": copy.deepcopy(self.partial),
            "tokens": list(self.tokens),
            "enc_start": self.enc_start,
            "dec_start": self.dec_start,
            "write_from": self.write_from,
            "tail_x": None if self.tail_x is None else self.tail_x.clone(),
            "tail_pre": None if self.tail_pre is None else self.tail_pre.clone(),
            "counts": {src: s.count for src, s in self.stores.items()},
        }

    def restore_private_state(self, st: dict) -> None:
        dev = self.rings.data.device
        self.rings.data.copy_(st["rings_data"].to(dev))
        self.rings.pos.copy_(st["rings_pos"].to(dev))
        self.partial = copy.deepcopy(st["partial"])
        self.tokens = list(st["tokens"])
        self.enc_start, self.dec_start, self.write_from = st["enc_start"], st["dec_start"], st["write_from"]
        self.tail_x = None if st["tail_x"] is None else st["tail_x"].to(dev)
        self.tail_pre = None if st["tail_pre"] is None else st["tail_pre"].to(dev)
        for src, n in st["counts"].items():
            self.stores[src].count = n
