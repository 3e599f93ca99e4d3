"""One Engram layer's table in host memory, in the checkpoint's stored form (the rows ``engram_host`` gathers).

The checkpoint stores each table as fp8 rows: e4m3 codes ``[R, hd]`` with one e8m0 exponent per 1x32 block,
``[R, hd/32]`` (model.md §4). A ``HostTable`` keeps exactly those bytes (uint8 views), taken from a checkpoint
(``from_stored``) or from a float table that fp8 rows hold exactly (``from_weight``: a snapped random model, a
dequantised load), so no float copy of a multi-GB table is ever made. A table fp8 rows cannot hold exactly
stays float (``scale=None``). With ``pin`` the memory is page-locked, so the device copies are DMA.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flashtier.kernels.quant.fp8_weight import as_raw_bytes, dequantize_fp8_weight, quantize_fp8_weight

ROW_BLOCK = (1, 32)  # the checkpoint's fp8_rows scale block (one e8m0 per 32 values of a row)
_CHUNK_ROWS = 1 << 18  # rows quantised at a time when a float table moves to the host


def _table_memory(shape: tuple[int, ...], dtype: torch.dtype, pin: bool) -> torch.Tensor:
    """Host memory for a whole table, pinned when ``pin``. torch's pinned allocator rounds a block up to a
    power of two (a 98 GB V4.1 table locks 128 GB); registering plain memory in place would avoid that."""
    return torch.empty(shape, dtype=dtype, pin_memory=pin)


@dataclass(frozen=True)
class HostTable:
    """One Engram layer's table in host memory, in the checkpoint's stored form.

    ``data [R, hd]`` e4m3 codes as uint8 with ``scale [R, hd/32]`` e8m0 exponents as uint8; or float rows
    with ``scale=None`` (a table that fp8 rows cannot hold exactly is kept as it was).
    """

    data: torch.Tensor
    scale: torch.Tensor | None

    def __post_init__(self):
        if self.data.dim() != 2 or self.data.device.type != "cpu":
            raise ValueError(f"data must be a 2-D host tensor [R, hd], got {tuple(self.data.shape)} on "
                             f"{self.data.device}")
        if self.scale is not None:
            r, hd = self.data.shape
            want = (r, -(-hd // ROW_BLOCK[1]))
            if self.data.dtype != torch.uint8 or self.scale.dtype != torch.uint8 or tuple(self.scale.shape) != want:
                raise ValueError(f"scale must be uint8 {want} beside uint8 codes {tuple(self.data.shape)}, got "
                                 f"{self.scale.dtype} {tuple(self.scale.shape)} and codes {self.data.dtype}")

    @property
    def num_rows(self) -> int:
        return self.data.shape[0]

    @property
    def nbytes(self) -> int:
        extra = 0 if self.scale is None else self.scale.numel()
        return self.data.numel() * self.data.element_size() + extra

    @classmethod
    def from_stored(cls, data: torch.Tensor, scale: torch.Tensor | None, *, pin: bool) -> HostTable:
        """The checkpoint's tensors (e4m3 ``[R, hd]`` + e8m0 ``[R, hd/32]``, any device) copied into host memory
        (pinned when ``pin``); without a copy when they are already plain host tensors and ``pin`` is False."""

        def host(t: torch.Tensor) -> torch.Tensor:
            t = as_raw_bytes(t) if scale is not None else t
            if not pin and t.device.type == "cpu":
                return t
            return _table_memory(tuple(t.shape), t.dtype, pin).copy_(t)

        return cls(host(data), None if scale is None else host(scale))

    @classmethod
    @torch.no_grad()
    def from_weight(cls, weight: torch.Tensor, *, pin: bool) -> HostTable:
        """A float table ``[R, hd]`` (any device) stored as fp8 rows in host memory, chunk by chunk, when that is
        exact (a snapped or loaded table); else the float rows themselves. On ``weight``'s device it needs only
        a few chunk-sized temporaries (``_CHUNK_ROWS`` rows)."""
        r, hd = weight.shape
        codes = _table_memory((r, hd), torch.uint8, pin)
        scales = _table_memory((r, -(-hd // ROW_BLOCK[1])), torch.uint8, pin)
        for a in range(0, r, _CHUNK_ROWS):
            w = weight[a : a + _CHUNK_ROWS]
            q, s = quantize_fp8_weight(w.float(), block=ROW_BLOCK)
            back = dequantize_fp8_weight(q, s, block=ROW_BLOCK).to(w.dtype)
            if not (torch.equal(back, w) and torch.equal(back.signbit(), w.signbit())):
                del codes, scales
                return cls(_table_memory((r, hd), weight.dtype, pin).copy_(weight), None)
            codes[a : a + _CHUNK_ROWS].copy_(as_raw_bytes(q))
            scales[a : a + _CHUNK_ROWS].copy_(as_raw_bytes(s))
        return cls(codes, scales)
