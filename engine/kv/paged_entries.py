"""One KV source's global entries of one sequence, stored in the paged pool (the model's ``GlobalEntries``).

Entry j of a stream with e entries per block lives in ``table[j // e]`` at ``j % e``; writes quantise
the raw values to the stored format (FP4 + e4m3 main KV, MXFP4 index K) and reads dequantise them,
so every reader sees exactly what the oracle computes.
"""

from __future__ import annotations

import torch

from flashtier.engine.kv.block_table import BlockTable
from flashtier.kernels.quant.fp4 import dequantize_fp4, pack_fp4_record, quantize_fp4, unpack_fp4_record
from flashtier.kernels.quant.mxfp4 import (
    dequantize_mxfp4,
    pack_mxfp4_record,
    quantize_mxfp4,
    unpack_mxfp4_record,
)
from flashtier.kvstore.kv_pool import GlobalKVPool


class PagedEntries:
    """One KV source's global entries of one sequence, stored in the paged pool."""

    def __init__(
        self, pool: GlobalKVPool, stream: int, per_block: int, ratio: int, table: BlockTable, head_dim: int,
        index_dim: int, dtype: torch.dtype,
    ):
        """``per_block`` entries per block; ``ratio`` tokens per entry (the source's compression ratio)."""
        self.pool, self.stream, self.per_block, self.ratio, self.table = pool, stream, per_block, ratio, table
        self.head_dim, self.index_dim, self.dtype = head_dim, index_dim, dtype
        self.count = 0

    def count_at(self, position: int) -> int:
        """Entries complete once the tokens below ``position`` are in (the entry-count formula)."""
        return position // self.ratio

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
