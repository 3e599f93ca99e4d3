"""The one byte layout of global KV and window state (owned here; everything else asks this module).

A token block of ``block_size`` tokens holds, for every global stream (one per KV-source layer), the
entries those tokens produce: ``block_size // ratio`` of them. Its persistent byte image::

    block = | S2 main | S2 index | S8 main | S8 index | S14 main | S14 index | S20 main | S20 index |
    main  = entries x (hd/2 e2m1 codes, even index in the low nibble | hd/16 e4m3 scales)   288 B/entry
    index = entries x (ID/2 e2m1 codes                                | ID/32 e8m0 scales)    68 B/entry

For the real geometry: (3 x 32 + 64) entries x 356 B = 56,960 B per 64-token block = 64 x 890.
A window slot (one layer, one position) is hd e4m3 bytes + hd/32 ue8m0 scale bytes = 528 B.

``KVGeometry`` is kvstore's own contract object; the engine builds it from the model config.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVGeometry:
    """What the cache needs to know about the model (no model import)."""

    head_dim: int  # main latent width (512)
    index_head_dim: int  # indexer key width (128)
    source_ratios: tuple[int, ...]  # compression ratio of each global stream, in source-layer order
    window: int  # sliding window (slots per ring)
    n_window_layers: int  # layers that keep a window ring (every backbone layer)
    n_encoder_window_layers: int  # of which encoder layers (the snapshot holds these)

    @property
    def main_entry_bytes(self) -> int:
        return self.head_dim // 2 + self.head_dim // 16

    @property
    def index_entry_bytes(self) -> int:
        return self.index_head_dim // 2 + self.index_head_dim // 32

    @property
    def entry_bytes(self) -> int:
        return self.main_entry_bytes + self.index_entry_bytes

    @property
    def window_slot_bytes(self) -> int:
        return self.head_dim + self.head_dim // 32

    def entries_per_block(self, block_size: int) -> tuple[int, ...]:
        for r in self.source_ratios:
            if block_size % r:
                raise ValueError(f"block_size {block_size} must be a multiple of every ratio {self.source_ratios}")
        return tuple(block_size // r for r in self.source_ratios)


@dataclass(frozen=True)
class BlockLayout:
    """Byte offsets of each stream's main and index rows inside one block image."""

    geometry: KVGeometry
    block_size: int

    @property
    def block_bytes(self) -> int:
        return sum(self.entries_per_block) * self.geometry.entry_bytes

    @property
    def entries_per_block(self) -> tuple[int, ...]:
        return self.geometry.entries_per_block(self.block_size)

    def stream_offsets(self, stream: int) -> tuple[int, int]:
        """(main offset, index offset) in bytes of stream ``stream`` inside the block image."""
        g = self.geometry
        off = 0
        for s, n in enumerate(self.entries_per_block):
            if s == stream:
                return off, off + n * g.main_entry_bytes
            off += n * g.entry_bytes
        raise IndexError(f"stream {stream} out of range (have {len(self.entries_per_block)})")

    def bytes_per_token(self) -> float:
        return self.block_bytes / self.block_size

    def allocate(self, num_blocks: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """The global pool: uint8 [num_blocks, block_bytes] (``device='meta'`` allocates nothing)."""
        return torch.empty(num_blocks, self.block_bytes, dtype=torch.uint8, device=device)

    def split(self, pool: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Views of a pool [N, block_bytes] per stream: (main [N, e, 288], index [N, e, 68])."""
        g = self.geometry
        out = []
        for s, n in enumerate(self.entries_per_block):
            mo, io = self.stream_offsets(s)
            main = pool[:, mo : mo + n * g.main_entry_bytes].unflatten(1, (n, g.main_entry_bytes))
            index = pool[:, io : io + n * g.index_entry_bytes].unflatten(1, (n, g.index_entry_bytes))
            out.append((main, index))
        return out


def allocate_window_rings(geometry: KVGeometry, device: torch.device | str = "cpu") -> torch.Tensor:
    """One sequence's window rings: uint8 [n_window_layers, window, slot_bytes]."""
    g = geometry
    return torch.empty(g.n_window_layers, g.window, g.window_slot_bytes, dtype=torch.uint8, device=device)
