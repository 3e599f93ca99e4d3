"""Every layer's sliding-window ring of one sequence, stored as FP8 records (528 B per slot in V4.1)."""

from __future__ import annotations

import torch

from flashtier.engine.model.layer_forward import LocalKeys
from flashtier.engine.kv.ring_arena import RingArena
from flashtier.kernels.quant.fp8 import dequantize_fp8, pack_fp8_record, quantize_fp8, unpack_fp8_record


class WindowRings:
    """Every layer's window ring of one sequence: FP8 records [L, W, hd + hd/32] and positions [L, W]."""

    def __init__(self, n_layers: int, window: int, head_dim: int, dtype: torch.dtype, device: torch.device | str,
                 arena: RingArena | None = None):
        """Rings in a slot of ``arena`` when it has a free one (``slot`` is then set), else private tensors."""
        self.head_dim, self.dtype, self.window = head_dim, dtype, window
        self.slot = arena.acquire() if arena is not None else None
        if self.slot is not None:
            self.data, self.pos = arena.views(self.slot)
            arena.release_when_dead(self, self.slot)
        else:
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
