"""Read a DeepSeek-V4.1 safetensors checkpoint and hand out dequantized tensors by their official names.

The stored format of each tensor is detected from the shard headers alone (model.md §4):

  NAME (.weight)       sibling PREFIX.scale          format     logical shape
  F8_E4M3 [N, K]       F8_E8M0 [ceil(N/32), ceil(K/32)]  fp8        [N, K]   one scale per 32x32 block
  F8_E4M3 [N, K]       F8_E8M0 [N, ceil(K/32)]       fp8_rows   [N, K]   one scale per 1x32 row block (Engram)
  I8      [N, K/2]     F8_E8M0 [N, K/32]             mxfp4      [N, K]   e2m1 pairs, even index in low nibble
  BF16 / F32 / F16     -                             plain      as stored, cast to the requested dtype

Integer tensors (index tables such as `gate.tid2eid`) are returned with their stored dtype.
Nothing reads tensor data until `load()` is iterated; shards are opened on first use.
"""

from __future__ import annotations

import enum
import json
import logging
import math
import os
import struct
from collections.abc import Iterator, Mapping, Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import NamedTuple

import torch
from safetensors import safe_open
from tqdm import tqdm

from flashtier.kernels.quant.fp8_weight import dequantize_fp8_weight
from flashtier.kernels.quant.mxfp4 import dequantize_mxfp4

logger = logging.getLogger("flashtier.engine.checkpoint")

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
FP8_BLOCK = (32, 32)
FP8_ROWS_BLOCK = (1, 32)
MXFP4_GROUP = 32
# Multimodal weights of V4.1 that the text-only model never consumes.
VISION_PREFIXES = ("vision.", "aligner.", "image_start", "image_end", "image_newline")


class CheckpointError(ValueError):
    """The files on disk do not match what the model expects: missing, mis-shaped, extra or corrupt tensors."""


class StorageFormat(str, enum.Enum):
    """How one logical tensor is laid out on disk (the value is the string the model code uses)."""

    FP8 = "fp8"
    FP8_ROWS = "fp8_rows"
    MXFP4 = "mxfp4"
    BF16 = "bf16"
    FP32 = "fp32"

    @property
    def quantized(self) -> bool:
        """True when the tensor is stored as codes plus a sibling `.scale` tensor."""
        return self in (StorageFormat.FP8, StorageFormat.FP8_ROWS, StorageFormat.MXFP4)


class TensorInfo(NamedTuple):
    """One stored tensor as its shard header describes it."""

    name: str
    dtype: str  # safetensors dtype tag, e.g. "F8_E4M3", "I8", "BF16"
    shape: tuple[int, ...]
    shard: str  # file name inside the checkpoint directory
    offset: int  # start of the data within the shard's data section (for sequential reads)


class TensorPlan(NamedTuple):
    """How to rebuild one logical tensor from what is stored."""

    name: str
    fmt: StorageFormat | None  # None: an unquantized dtype other than BF16/F32 (F16, integer tables)
    shape: tuple[int, ...]  # logical (dequantized) shape
    data: TensorInfo
    scale: TensorInfo | None


def scale_name(weight_name: str) -> str:
    """`layers.3.attn.wq_a.weight` -> `layers.3.attn.wq_a.scale`."""
    if not weight_name.endswith(".weight"):
        raise CheckpointError(f"{weight_name}: quantized tensors must be named '*.weight' (scale goes in '*.scale')")
    return weight_name[: -len(".weight")] + ".scale"


def dequantize(
    fmt: StorageFormat | None, data: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype
) -> torch.Tensor:
    """Stored tensor(s) -> logical tensor; the single definition shared by load() and quantize_roundtrip()."""
    if fmt is StorageFormat.FP8:
        return dequantize_fp8_weight(data, scale, dtype=dtype, block=FP8_BLOCK)
    if fmt is StorageFormat.FP8_ROWS:
        return dequantize_fp8_weight(data, scale, dtype=dtype, block=FP8_ROWS_BLOCK)
    if fmt is StorageFormat.MXFP4:
        # The kernels take raw bytes: packed e2m1 pairs and e8m0 exponents, both as uint8.
        return dequantize_mxfp4(data.view(torch.uint8), scale.view(torch.uint8), dtype=dtype)
    return data.to(dtype) if data.is_floating_point() else data


def read_header(path: Path) -> dict[str, TensorInfo]:
    """Parse a safetensors header (u64 little-endian length + JSON) without touching tensor data."""
    with open(path, "rb") as f:
        raw = f.read(8)
        size = os.fstat(f.fileno()).st_size
        if len(raw) != 8 or struct.unpack("<Q", raw)[0] > size - 8:
            raise CheckpointError(f"{path}: not a safetensors file or truncated header ({size} bytes)")
        try:
            header = json.loads(f.read(struct.unpack("<Q", raw)[0]))
        except ValueError as e:
            raise CheckpointError(f"{path}: corrupt safetensors header ({e})") from None
    header.pop("__metadata__", None)
    return {
        name: TensorInfo(name, entry["dtype"], tuple(entry["shape"]), path.name, entry["data_offsets"][0])
        for name, entry in header.items()
    }


def read_config(directory: str | os.PathLike) -> dict:
    """The checkpoint's config.json as a dict."""
    path = Path(directory) / CONFIG_FILE
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing; a checkpoint directory needs a {CONFIG_FILE}") from None
    except ValueError as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from None


def _shape(shape: Sequence[int]) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


def _preview(names: Sequence[str], limit: int = 8) -> str:
    more = f" ... and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


class CheckpointReader:
    """A checkpoint directory: `model.safetensors.index.json` + shards, or a single `model.safetensors`.

    Construction reads only the index and the shard headers, so `tensors` (every stored name, dtype
    and shape) is known without reading any data. `load()` validates the whole request against the
    headers before returning, then streams tensors shard by shard.
    """

    def __init__(self, directory: str | os.PathLike) -> None:
        self.directory = Path(directory)
        self.tensors: dict[str, TensorInfo] = self._read_headers()

    def _read_headers(self) -> dict[str, TensorInfo]:
        index = self.directory / INDEX_FILE
        if not index.is_file():
            if not (self.directory / SINGLE_FILE).is_file():
                raise CheckpointError(
                    f"{self.directory}: no {INDEX_FILE} or {SINGLE_FILE}; not a safetensors checkpoint")
            return read_header(self.directory / SINGLE_FILE)
        try:
            weight_map = dict(json.loads(index.read_text())["weight_map"])
        except (ValueError, KeyError, TypeError) as e:
            raise CheckpointError(
                f"{index}: unreadable index ({e!r}); expected {{'weight_map': {{name: shard}}}}") from None
        tensors: dict[str, TensorInfo] = {}
        for shard in sorted(set(weight_map.values())):
            if not (self.directory / shard).is_file():
                raise CheckpointError(f"{self.directory}: shard {shard} named in {INDEX_FILE} is missing")
            header = read_header(self.directory / shard)
            tensors.update((n, info) for n, info in header.items() if weight_map.get(n) == shard)
        absent = [n for n in weight_map if n not in tensors]
        if absent:
            raise CheckpointError(f"{index}: maps tensors to shards that do not contain them: {_preview(absent)}")
        return tensors

    def plan(self, name: str) -> TensorPlan:
        """Detect the stored format of logical tensor `name` from the headers (CheckpointError if inconsistent)."""
        data = self.tensors[name]
        scale = self.tensors.get(scale_name(name)) if name.endswith(".weight") else None
        if data.dtype == "F8_E4M3":
            if scale is None or scale.dtype != "F8_E8M0" or len(data.shape) != 2:
                raise CheckpointError(
                    f"{name}: stored as F8_E4M3 {_shape(data.shape)} without a 2-D weight and an F8_E8M0 "
                    f"sibling '{name.removesuffix('.weight')}.scale'; the checkpoint is incomplete")
            n, k = data.shape
            grid, rows = (math.ceil(n / 32), math.ceil(k / 32)), (n, math.ceil(k / 32))
            if scale.shape not in (grid, rows):
                raise CheckpointError(
                    f"{scale.name}: scale shape {_shape(scale.shape)} fits neither 32x32 blocks {_shape(grid)} "
                    f"nor 1x32 rows {_shape(rows)} of {name} {_shape(data.shape)}")
            fmt = StorageFormat.FP8 if scale.shape == grid else StorageFormat.FP8_ROWS
            return TensorPlan(name, fmt, data.shape, data, scale)
        if data.dtype in ("I8", "U8") and scale is not None and scale.dtype == "F8_E8M0":
            n, k = (data.shape[0], 2 * data.shape[1]) if len(data.shape) == 2 else (-1, -1)
            if n < 0 or k % MXFP4_GROUP or scale.shape != (n, k // MXFP4_GROUP):
                raise CheckpointError(
                    f"{name}: mxfp4 codes {_shape(data.shape)} and scale {_shape(scale.shape)} are inconsistent; "
                    f"expected codes [N, K/2] with scale [N, K/32]")
            return TensorPlan(name, StorageFormat.MXFP4, (n, k), data, scale)
        fmt = {"BF16": StorageFormat.BF16, "F32": StorageFormat.FP32}.get(data.dtype)
        return TensorPlan(name, fmt, data.shape, data, None)

    def load(
        self,
        expected: Mapping[str, Sequence[int]],
        *,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        progress: bool = True,
        strict: bool = True,
        skip: tuple[str, ...] = (),
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield `(name, tensor)` for every expected logical tensor, dequantized to `dtype` on `device`.

        Args:
            expected: logical name -> logical shape, e.g. {"layers.3.attn.wq_a.weight": (1280, 5120)}.
            strict: stored tensors that are neither expected, a consumed `.scale`, vision weights nor under
                `skip` raise; with strict=False they are ignored with one log line.
            skip: name prefixes of stored tensors the caller knowingly leaves unread, without a word (the
                DSpark drafter's `mtp.` when speculation is off).
        Raises:
            CheckpointError: before anything is read, listing every missing, mis-shaped or extra tensor.
        Tensors come shard by shard in on-disk order, not in `expected` order. Quantized tensors
        travel to `device` as codes and are dequantized there.
        """
        plans = self._validate(expected, strict, skip)
        return self._stream(plans, dtype, torch.device(device), progress)

    def load_stored(
        self, expected: Mapping[str, Sequence[int]], *, device: str | torch.device = "cpu", progress: bool = True,
        strict: bool = True, skip: tuple[str, ...] = (),
    ) -> Iterator[tuple[TensorPlan, torch.Tensor, torch.Tensor | None]]:
        """Like ``load`` but nothing is dequantised: ``(plan, data, scale)`` with the stored bytes on ``device``
        (what a GPU model keeps resident: FP8 codes + E8M0 scales, MXFP4 codes + scales, bf16, fp32)."""
        plans = self._validate(expected, strict, skip)
        return self._stream(plans, None, torch.device(device), progress)

    def validate(self, expected: Mapping[str, Sequence[int]], *, strict: bool = True, skip: tuple[str, ...] = ()
                 ) -> list[TensorPlan]:  # fmt: skip
        """The plan of every expected tensor, checked as ``load`` checks them (same arguments), reading only
        the headers: for a caller that reads the data itself (sharded_reader.py). Raises CheckpointError."""
        return self._validate(expected, strict, skip)

    def _validate(self, expected: Mapping[str, Sequence[int]], strict: bool, skip: tuple[str, ...] = ()
                  ) -> list[TensorPlan]:  # fmt: skip
        problems, plans, consumed = [], [], set()
        missing = [n for n in expected if n not in self.tensors]
        if missing:
            problems.append(f"{len(missing)} expected tensor(s) missing: {_preview(missing)}")
        for name, want in expected.items():
            if name not in self.tensors:
                continue
            try:
                plan = self.plan(name)
            except CheckpointError as e:
                problems.append(str(e))
                consumed.update([name, scale_name(name)] if name.endswith(".weight") else [name])
                continue
            consumed.update([name] + ([plan.scale.name] if plan.scale else []))
            if tuple(want) != plan.shape:
                stored = f"{plan.data.dtype} {_shape(plan.data.shape)}"
                if plan.scale is not None:
                    stored += f" ({plan.fmt.value}, logical shape {_shape(plan.shape)})"
                problems.append(f"{name}: expected shape {_shape(want)}, checkpoint stores {stored}")
            plans.append(plan)
        leftover = [n for n in self.tensors if n not in consumed and not (skip and n.startswith(skip))]
        vision = [n for n in leftover if n.startswith(VISION_PREFIXES)]
        extra = [n for n in leftover if not n.startswith(VISION_PREFIXES)]
        if vision:
            logger.info("skipping %d vision tensors (vision.*, aligner.*, image_*): image input is not supported yet",
                        len(vision))
        if extra and strict:
            problems.append(f"{len(extra)} unexpected tensor(s) the model does not use: {_preview(extra)} "
                            f"(pass strict=False to ignore them)")
        elif extra:
            logger.info("ignoring %d unexpected tensors (strict=False): %s", len(extra), _preview(extra))
        if problems:
            raise CheckpointError(f"checkpoint {self.directory} does not match the model:\n  " + "\n  ".join(problems))
        return plans

    def _stream(self, plans: list[TensorPlan], dtype: torch.dtype | None, device: torch.device,
                progress: bool) -> Iterator[tuple[str, torch.Tensor]]:
        """Dequantised ``(name, tensor)`` in ``dtype``, or with ``dtype=None`` the stored ``(plan, data, scale)``."""
        plans = sorted(plans, key=lambda p: (p.data.shard, p.data.offset))
        with ExitStack() as stack, tqdm(total=len(plans), desc="Loading checkpoint", unit="tensor",
                                        disable=not progress) as bar:
            handles = {}

            def read(info: TensorInfo) -> torch.Tensor:
                if info.shard not in handles:
                    path = self.directory / info.shard
                    handles[info.shard] = stack.enter_context(safe_open(path, framework="pt"))
                return handles[info.shard].get_tensor(info.name).to(device)

            for plan in plans:
                scale = read(plan.scale) if plan.scale is not None else None
                if dtype is None:
                    yield plan, read(plan.data), scale
                else:
                    yield plan.name, dequantize(plan.fmt, read(plan.data), scale, dtype)
                bar.update(1)
