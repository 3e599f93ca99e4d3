"""The runtime global-KV pool: one byte tensor of block images, addressed by (stream, block, offset).

Storage only: kvstore never quantises or interprets values (the engine writes FP4/MXFP4 records made
by the kernels ops). Block ids come from ``BlockPool``; this class holds their bytes::

    data [num_blocks, block_bytes]       one row = one block image (kvstore/layout.py)
    stream s:  main  [num_blocks, e_s, 288]   views into data
               index [num_blocks, e_s, 68]

An entry j of stream s lives in block ``table[j // e_s]`` at offset ``j % e_s``.
"""

from __future__ import annotations

import torch

from flashtier.kvstore.layout import BlockLayout


class GlobalKVPool:
    def __init__(self, layout: BlockLayout, num_blocks: int, device: torch.device | str = "cpu"):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.layout = layout
        self.data = layout.allocate(num_blocks, device)
        self.data.zero_()
        self.streams = layout.split(self.data)

    @property
    def num_blocks(self) -> int:
        return self.data.shape[0]

    def write(
        self, stream: int, blocks: torch.Tensor, offsets: torch.Tensor, main: torch.Tensor, index: torch.Tensor
    ) -> None:
        """Store entry records: main [G, main_bytes] and index [G, index_bytes] uint8 at (blocks, offsets).

        Mutates the pool bytes. The caller owns the blocks (ref count > 0) and never writes a block
        that is shared and full (cached blocks are immutable).
        """
        m, i = self.streams[stream]
        m[blocks, offsets] = main
        i[blocks, offsets] = index

    def read_main(self, stream: int, blocks: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        return self.streams[stream][0][blocks, offsets]

    def read_index(self, stream: int, blocks: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        return self.streams[stream][1][blocks, offsets]

    def image(self, block_id: int) -> bytes:
        """The block's persistent byte image (``block_bytes`` long), e.g. for the SSD tier."""
        return self.data[block_id].cpu().numpy().tobytes()

    def load_image(self, block_id: int, image: bytes) -> None:
        """Overwrite a block with a byte image (SSD load, preemption swap-in). Mutates the pool."""
        if len(image) != self.layout.block_bytes:
            raise ValueError(f"block image has {len(image)} bytes, expected {self.layout.block_bytes}")
        self.data[block_id] = torch.frombuffer(bytearray(image), dtype=torch.uint8).to(self.data.device)

    def copy_block(self, src: int, dst: int) -> None:
        self.data[dst] = self.data[src]
