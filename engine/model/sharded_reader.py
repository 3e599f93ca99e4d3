"""Read only a rank's part of a checkpoint: byte ranges of the safetensors shards, in their stored formats.

    slices = rank_slices(sharded_meta_model)           engine/parallel: name -> TensorSlice (the rest: whole)
    for part in read_slices(reader, full_shapes, wanted, slices):
        part.values(torch.float32)                     the rank's values (dequantised)
        part.stored()                                  or its codes + scales as stored (block-aligned slices)

A safetensors shard is ``u64 header length | JSON header | data``; each tensor is row-major at
``data start + data_offsets[0]``. What one tensor costs to read::

    whole tensor, or a row slice (axis 0)     one contiguous range: one read
    column slice (axis 1) of [N, K]           strided: the covering range, from row 0's first column to row
                                              N-1's last, in one read; the columns are copied out in memory

The checkpoint's column-sliced tensors (attention ``wo_b`` and the experts' ``w2`` under TP without EP)
have rows of a few KB, no wider than a page or two: one read per row would move the same pages with N
calls, so the covering range is the cheaper of the two. Under EP the routed experts are whole tensors.

Quantised tensors are cut on their block grid (``fp8``: 32 x 32, ``fp8_rows`` / ``mxfp4``: 1 x 32 along
K, mxfp4 codes two per byte): the read covers whole blocks, codes and scales both, and a ``StoredSlice``
keeps the ``window`` of the wanted elements inside them. Dequantisation is elementwise (code x 2^scale),
so the window of the covering blocks' values equals the slice of the whole tensor's values, bit for bit.
Only the bytes of ``wanted`` names are read; no whole-model buffer exists (one tensor's covering range at
a time).
"""

from __future__ import annotations

import math
import os
import struct
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from flashtier.engine.model.checkpoint_reader import (
    FP8_BLOCK,
    FP8_ROWS_BLOCK,
    MXFP4_GROUP,
    CheckpointError,
    CheckpointReader,
    StorageFormat,
    TensorInfo,
    TensorPlan,
    dequantize,
)

# safetensors dtype tag -> the torch dtype ``safe_open`` returns for it (the stored bytes, viewed)
STORED_DTYPES = {
    "F8_E4M3": torch.float8_e4m3fn, "F8_E8M0": torch.float8_e8m0fnu, "I8": torch.int8, "U8": torch.uint8,
    "BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
    "I16": torch.int16, "I32": torch.int32, "I64": torch.int64, "BOOL": torch.bool,
}
# (rows, columns) of logical elements one scale covers; columns per stored code byte
_BLOCK = {StorageFormat.FP8: FP8_BLOCK, StorageFormat.FP8_ROWS: FP8_ROWS_BLOCK, StorageFormat.MXFP4: (1, MXFP4_GROUP)}
_PACK = {StorageFormat.MXFP4: 2}


@dataclass(frozen=True)
class TensorSlice:
    """The part of one logical checkpoint tensor a rank holds: ``[start, start + size)`` along ``axis``."""

    axis: int  # 0: rows (or the only axis of a 1-D tensor), 1: columns of a 2-D tensor
    start: int
    size: int

    @property
    def stop(self) -> int:
        return self.start + self.size


@dataclass(frozen=True)
class ByteRange:
    """Bytes ``[offset, offset + nbytes)`` of one file: a stored tensor inside a safetensors shard."""

    path: Path
    offset: int  # from the start of the file
    nbytes: int


@dataclass(frozen=True)
class StoredSlice:
    """One tensor's slice as read: the stored tensors of the blocks covering it, and where it lies in them.

    ``data`` / ``scale`` are a valid stored tensor pair of the covering blocks (as ``load_stored`` would
    yield for a tensor of that shape); ``window`` selects the wanted logical elements of their values
    (``None``: all of them, the read was block-aligned or the tensor whole).
    """

    plan: TensorPlan
    data: torch.Tensor
    scale: torch.Tensor | None
    window: tuple[slice, ...] | None

    @property
    def name(self) -> str:
        return self.plan.name

    def values(self, dtype: torch.dtype) -> torch.Tensor:
        """The slice's logical values in ``dtype`` (dequantised; integer tables keep their dtype). A new tensor."""
        out = dequantize(self.plan.fmt, self.data, self.scale, dtype)
        return out if self.window is None else out[self.window].contiguous()

    def stored(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The slice as stored: ``(codes, scales)`` (scales None for a plain tensor). ValueError when the slice
        cuts a quantisation block (its codes would need another scale than the checkpoint's)."""
        if self.window is not None:
            raise ValueError(f"{self.name}: the slice {self.window} cuts the {self.plan.fmt.value} blocks; "
                             "only its dequantised values exist")
        return self.data, self.scale


def data_start(path: Path) -> int:
    """File offset of a safetensors shard's data section (8 + the header's length)."""
    with open(path, "rb") as f:
        return 8 + struct.unpack("<Q", f.read(8))[0]


def _nbytes(info: TensorInfo) -> int:
    return math.prod(info.shape) * STORED_DTYPES[info.dtype].itemsize


class _Files:
    """Open shards of one checkpoint (one descriptor each, closed by ``close``) and their data offsets."""

    def __init__(self, directory: Path):
        self.directory = directory
        self._fds: dict[str, tuple[int, int]] = {}

    def locate(self, info: TensorInfo) -> ByteRange:
        return ByteRange(self.directory / info.shard, self._open(info.shard)[1] + info.offset, _nbytes(info))

    def _open(self, shard: str) -> tuple[int, int]:
        if shard not in self._fds:
            path = self.directory / shard
            self._fds[shard] = (os.open(path, os.O_RDONLY), data_start(path))
        return self._fds[shard]

    def read(self, info: TensorInfo, offset: int, nbytes: int) -> torch.Tensor:
        """``nbytes`` bytes of ``info``'s data from ``offset`` (relative to the tensor's first byte): one
        contiguous read into a new uint8 tensor. CheckpointError when the file ends first."""
        fd, start = self._open(info.shard)
        buf = torch.empty(nbytes, dtype=torch.uint8)
        view, done = memoryview(buf.numpy()), 0
        while done < nbytes:  # pread may return short on large ranges
            got = os.preadv(fd, [view[done:]], start + info.offset + offset + done)
            if got <= 0:
                raise CheckpointError(f"{self.directory / info.shard}: ends inside {info.name}")
            done += got
        return buf

    def close(self) -> None:
        for fd, _ in self._fds.values():
            os.close(fd)
        self._fds.clear()


def _read_box(files: _Files, info: TensorInfo, axis: int, start: int, stop: int) -> torch.Tensor:
    """Elements ``[start, stop)`` along ``axis`` of stored tensor ``info`` (stored units: bytes for codes),
    as a new tensor of its stored dtype (module docstring: row slices one range, column slices the covering
    range)."""
    dtype = STORED_DTYPES[info.dtype]
    shape = info.shape if info.shape else (1,)
    rows, cols = shape[0], math.prod(shape[1:])
    es = dtype.itemsize
    if axis == 0:
        out = files.read(info, start * cols * es, (stop - start) * cols * es).view(dtype)
        return out.view(stop - start, *shape[1:]) if info.shape else out.view(())
    if len(shape) != 2:
        raise CheckpointError(f"{info.name}: a column slice needs a 2-D tensor, stored shape {list(info.shape)}")
    first, last = start * es, (rows - 1) * cols * es + stop * es  # byte range covering every row's columns
    covering = files.read(info, first, last - first).view(dtype)
    return covering.as_strided((rows, stop - start), (cols, 1)).clone()


def _plan_slice(plan: TensorPlan, cut: TensorSlice | None) -> tuple[int, int, int, tuple[slice, ...] | None]:
    """(axis, first, stop) of the whole blocks covering ``cut`` in logical elements, and the window of ``cut``
    inside them (None when they coincide)."""
    if cut is None:
        return 0, 0, plan.shape[0] if plan.shape else 1, None
    n = plan.shape[cut.axis] if 0 <= cut.axis < len(plan.shape) else 0
    if not 0 <= cut.start < cut.stop <= n:
        raise CheckpointError(f"{plan.name}: slice {cut} does not fit the logical shape {list(plan.shape)}")
    block = _BLOCK.get(plan.fmt, (1, 1))[cut.axis]
    first, stop = cut.start // block * block, min(n, -(-cut.stop // block) * block)
    if (first, stop) == (cut.start, cut.stop):
        return cut.axis, first, stop, None
    window = [slice(None)] * len(plan.shape)
    window[cut.axis] = slice(cut.start - first, cut.stop - first)
    return cut.axis, first, stop, tuple(window)


def read_slice(files: _Files, plan: TensorPlan, cut: TensorSlice | None) -> StoredSlice:
    """Read ``plan``'s part ``cut`` (None: whole) with its covering scales; see the module docstring."""
    axis, first, stop, window = _plan_slice(plan, cut)
    if plan.scale is None:
        data = _read_box(files, plan.data, axis, first, stop)
        return StoredSlice(plan, data, None, window)
    pack = _PACK.get(plan.fmt, 1)
    block = _BLOCK[plan.fmt][axis]
    code_unit = pack if axis == 1 else 1
    data = _read_box(files, plan.data, axis, first // code_unit, stop // code_unit)
    scale = _read_box(files, plan.scale, axis, first // block, -(-stop // block))
    return StoredSlice(plan, data, scale, window)


def read_slices(
    reader: CheckpointReader,
    expected: Mapping[str, Sequence[int]],
    wanted: Sequence[str],
    slices: Mapping[str, TensorSlice],
    *,
    strict: bool = True,
    skip: tuple[str, ...] = (),
    progress: bool = True,
) -> Iterator[StoredSlice]:
    """Yield a ``StoredSlice`` for each name of ``wanted``: its part ``slices[name]``, or the whole tensor.

    ``expected`` (logical name -> shape of the WHOLE model) is validated against the shard headers first, as
    ``CheckpointReader.load`` does (``strict`` / ``skip`` as there), so another rank's tensors are known, not
    unexpected. Raises CheckpointError before any data is read (a mismatch, or a name of ``wanted`` not in
    ``expected``). Tensors come in file order (shard, offset); one tqdm bar over the bytes read when
    ``progress``.
    """
    plans = {p.name: p for p in reader.validate(expected, strict=strict, skip=skip)}
    unknown = [n for n in wanted if n not in plans]
    if unknown:
        raise CheckpointError(f"{reader.directory}: wanted tensors the model does not expect: {unknown[:8]}")
    order = sorted(wanted, key=lambda n: (plans[n].data.shard, plans[n].data.offset))
    files = _Files(reader.directory)
    try:
        with tqdm(total=None, desc="Loading shard", unit="B", unit_scale=True, disable=not progress) as bar:
            for name in order:
                part = read_slice(files, plans[name], slices.get(name))
                bar.update(part.data.nbytes + (0 if part.scale is None else part.scale.nbytes))
                yield part
    finally:
        files.close()


def locate(reader: CheckpointReader, info: TensorInfo) -> ByteRange:
    """Where stored tensor ``info`` lies in its shard file (for a mapping instead of a read)."""
    files = _Files(reader.directory)
    try:
        return files.locate(info)
    finally:
        files.close()
