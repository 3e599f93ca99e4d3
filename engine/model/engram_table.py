"""One Engram layer's table in host memory, in the checkpoint's stored form (the rows ``engram_host`` gathers).

The checkpoint stores each table as fp8 rows: e4m3 codes ``[R, hd]`` with one e8m0 exponent per 1x32 block,
``[R, hd/32]`` (model.md §4). A ``HostTable`` keeps exactly those bytes (uint8 views), taken from a checkpoint
(``from_stored``) or from a float table that fp8 rows hold exactly (``from_weight``: a snapped random model, a
dequantised load), so no float copy of a multi-GB table is ever made. A table fp8 rows cannot hold exactly
stays float (``scale=None``). With ``pin`` the memory is page-locked, so the device copies are DMA.

``map_stored`` takes neither a copy nor a read: the table IS the checkpoint file's bytes, a shared read-only
mapping (``mmap`` of the tensor's range of its shard). Every process of a host that maps the same file
region shares the page cache's one copy of it, so the ranks of one host hold one copy of each table
(measured with PSS, which splits a shared page between its mappers; RSS counts it in full in each). On
CUDA the mapped range is registered in place (``cudaHostRegister``, read-only) rather than copied into
torch's pinned allocator, which rounds a block up to a power of two (a 98 GB table would lock 128 GB);
registration also faults every page in once, at load. When registration fails (an old driver, a file
system that refuses it) the table stays mapped and unregistered, with one warning: the gathers read it
on the host into pinned staging either way (engram_host.py), only page faults may then reach the disk.

``TableFile`` gives drawn tables (the demo weights, rank_random.py) the same one-copy-per-host form: a file of
codes then scales, filled once through a writable shared mapping and then mapped read-only by every rank as a
checkpoint's table is. Left unfilled it is sparse: holes read as zero codes (value 0), and no page exists
until touched (the one-GPU emulation of the real geometry, whose tables exceed the host's memory).
"""

from __future__ import annotations

import logging
import math
import mmap
import warnings
import weakref
from dataclasses import dataclass, field
from pathlib import Path

import torch

from flashtier.engine.model.sharded_reader import ByteRange
from flashtier.kernels.quant.fp8_weight import as_raw_bytes, dequantize_fp8_weight, quantize_fp8_weight

ROW_BLOCK = (1, 32)  # the checkpoint's fp8_rows scale block (one e8m0 per 32 values of a row)
_CHUNK_ROWS = 1 << 18  # rows quantised at a time when a float table moves to the host
# cudaHostRegisterPortable | cudaHostRegisterReadOnly: pinned for every context, without write access (the
# mapping is read-only; asking for write access would fail, or break the sharing on a private mapping)
_REGISTER_FLAGS = 0x01 | 0x08

log = logging.getLogger("flashtier.engine.model")


def map_region(region: ByteRange, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """A read-only tensor over ``region`` of its file, mapped shared (no copy, no read: pages come from the page
    cache on first touch). The tensor keeps the mapping alive; writing to it is an error (SIGSEGV: the pages
    are read-only). ValueError when ``shape`` x ``dtype`` does not fill the region."""
    if region.nbytes != math.prod(shape) * dtype.itemsize:
        raise ValueError(f"{region.path}: {region.nbytes} bytes at {region.offset} cannot hold {dtype} {list(shape)}")
    base = region.offset - region.offset % mmap.ALLOCATIONGRANULARITY
    with open(region.path, "rb") as f:
        mapped = mmap.mmap(f.fileno(), region.offset + region.nbytes - base, offset=base, access=mmap.ACCESS_READ)
    with warnings.catch_warnings():  # torch warns that the buffer is not writable: that is the point
        warnings.simplefilter("ignore", UserWarning)
        flat = torch.frombuffer(mapped, dtype=torch.uint8, count=region.nbytes, offset=region.offset - base)
    return flat.view(dtype).view(shape)


class _Registration:
    """A host range registered with CUDA; unregistered when collected (before its mapping can go away)."""

    def __init__(self, tensor: torch.Tensor):
        page = mmap.PAGESIZE
        start = tensor.data_ptr() - tensor.data_ptr() % page
        end = tensor.data_ptr() + tensor.numel() * tensor.element_size()
        self.ptr, self.nbytes = start, -(-(end - start) // page) * page
        self.ok = False
        self.tensor = tensor  # its mapping outlives the registration: the finaliser runs before this is dropped
        err = torch.cuda.cudart().cudaHostRegister(self.ptr, self.nbytes, _REGISTER_FLAGS)
        if int(err) != 0:
            log.warning("cudaHostRegister of a %.1f GB Engram table mapping failed (%s); it stays mapped, "
                        "unregistered", self.nbytes / 1e9, err)
            return
        self.ok = True
        weakref.finalize(self, torch.cuda.cudart().cudaHostUnregister, self.ptr)


def _register(tensor: torch.Tensor, register: bool) -> _Registration | None:
    return _Registration(tensor) if register and torch.cuda.is_available() else None


def _table_memory(shape: tuple[int, ...], dtype: torch.dtype, pin: bool) -> torch.Tensor:
    """Host memory for a whole table, pinned when ``pin``. torch's pinned allocator rounds a block up to a
    power of two (a 98 GB V4.1 table locks 128 GB); registering plain memory in place would avoid that."""
    return torch.empty(shape, dtype=dtype, pin_memory=pin)


def scale_shape(shape: tuple[int, int]) -> tuple[int, int]:
    """The e8m0 scales' shape beside fp8-row codes of ``shape`` ``[R, hd]``: ``[R, hd/32]`` (rounded up)."""
    return shape[0], -(-shape[1] // ROW_BLOCK[1])


def exact_fp8_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Float rows ``weight`` (any device) as fp8-row codes and scales (uint8 views), or None when fp8 rows do not
    hold them exactly (values and signs of zeros, compared in ``weight``'s dtype)."""
    q, s = quantize_fp8_weight(weight.float(), block=ROW_BLOCK)
    back = dequantize_fp8_weight(q, s, block=ROW_BLOCK).to(weight.dtype)
    if not (torch.equal(back, weight) and torch.equal(back.signbit(), weight.signbit())):
        return None
    return as_raw_bytes(q), as_raw_bytes(s)


@dataclass(frozen=True)
class HostTable:
    """One Engram layer's table in host memory, in the checkpoint's stored form.

    ``data [R, hd]`` e4m3 codes as uint8 with ``scale [R, hd/32]`` e8m0 exponents as uint8; or float rows
    with ``scale=None`` (a table that fp8 rows cannot hold exactly is kept as it was).
    """

    data: torch.Tensor
    scale: torch.Tensor | None
    # the CUDA registrations of a mapped table's ranges (kept alive with it); empty otherwise
    registered: tuple[_Registration, ...] = field(default=(), repr=False, compare=False)

    def __post_init__(self):
        if self.data.dim() != 2 or self.data.device.type != "cpu":
            raise ValueError(f"data must be a 2-D host tensor [R, hd], got {tuple(self.data.shape)} on "
                             f"{self.data.device}")
        if self.scale is not None:
            want = scale_shape(tuple(self.data.shape))
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

    @property
    def pinned(self) -> bool:
        """True when the table's memory is page-locked (pinned at allocation, or registered in place)."""
        return self.data.is_pinned() or (bool(self.registered) and all(r.ok for r in self.registered))

    @classmethod
    def map_stored(cls, data: ByteRange, scale: ByteRange, shape: tuple[int, int], *, register: bool) -> HostTable:
        """The table as its checkpoint stores it (e4m3 codes ``[R, hd]`` at ``data``, e8m0 scales ``[R, hd/32]``
        at ``scale``), mapped read-only and shared (``map_region``); with ``register`` and CUDA present, both
        ranges registered in place (module docstring; a failure leaves them unregistered with a warning).
        ValueError when the ranges do not hold those shapes."""
        r, hd = shape
        codes = map_region(data, torch.uint8, (r, hd))
        scales = map_region(scale, torch.uint8, scale_shape(shape))
        regs = tuple(x for x in (_register(codes, register), _register(scales, register)) if x is not None)
        return cls(codes, scales, regs)

    @classmethod
    @torch.no_grad()
    def from_weight(cls, weight: torch.Tensor, *, pin: bool) -> HostTable:
        """A float table ``[R, hd]`` (any device) stored as fp8 rows in host memory, chunk by chunk, when that is
        exact (a snapped or loaded table); else the float rows themselves. On ``weight``'s device it needs only
        a few chunk-sized temporaries (``_CHUNK_ROWS`` rows)."""
        r, hd = weight.shape
        codes = _table_memory((r, hd), torch.uint8, pin)
        scales = _table_memory(scale_shape((r, hd)), torch.uint8, pin)
        for a in range(0, r, _CHUNK_ROWS):
            rows = exact_fp8_rows(weight[a : a + _CHUNK_ROWS])
            if rows is None:
                del codes, scales
                return cls(_table_memory((r, hd), weight.dtype, pin).copy_(weight), None)
            codes[a : a + _CHUNK_ROWS].copy_(rows[0])
            scales[a : a + _CHUNK_ROWS].copy_(rows[1])
        return cls(codes, scales)


@dataclass(frozen=True)
class TableFile:
    """One table's bytes in a file of its own: e4m3 codes ``[R, hd]`` at offset 0, then e8m0 scales
    ``[R, hd/32]`` (the checkpoint's fp8 rows, as ``map_stored`` maps them)."""

    path: Path
    shape: tuple[int, int]

    @staticmethod
    def size(shape: tuple[int, int]) -> int:
        """The file's bytes for a table of ``shape``: its codes and its scales."""
        return math.prod(shape) + math.prod(scale_shape(shape))

    @property
    def ranges(self) -> tuple[ByteRange, ByteRange]:
        codes = math.prod(self.shape)
        return ByteRange(self.path, 0, codes), ByteRange(self.path, codes, math.prod(scale_shape(self.shape)))

    def create(self) -> None:
        """Create the file at its full size, sparse (every byte 0 until written)."""
        with open(self.path, "wb") as f:
            f.truncate(self.size(self.shape))

    def writable(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Writable shared views ``(codes, scales)`` of the created file: writes reach the file's pages, which
        every other mapping of it shares (several processes may fill disjoint rows at once)."""
        codes = math.prod(self.shape)
        flat = torch.from_file(str(self.path), shared=True, size=self.size(self.shape), dtype=torch.uint8)
        return flat[:codes].view(self.shape), flat[codes:].view(scale_shape(self.shape))

    def fill(self, codes: torch.Tensor, scales: torch.Tensor, start: int, weight: torch.Tensor) -> None:
        """Quantise float rows ``weight`` (any device; values fp8 rows hold exactly, e.g. drawn by
        ``draw_parameter``) into rows ``[start, start + len(weight))`` of the views ``writable`` returned.
        ValueError when they are not exact in fp8 rows."""
        rows = exact_fp8_rows(weight.float())
        if rows is None:
            raise ValueError(f"{self.path}: rows from {start} are not exact in fp8 rows")
        codes[start : start + weight.shape[0]].copy_(rows[0])
        scales[start : start + weight.shape[0]].copy_(rows[1])

    def map(self, *, register: bool) -> HostTable:
        """The file's table, mapped read-only and shared (``HostTable.map_stored``)."""
        return HostTable.map_stored(*self.ranges, self.shape, register=register)
