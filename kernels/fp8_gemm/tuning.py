"""Launch choices of the FP8 GEMM per weight shape: the reduction order (fixed per (N, K, device)) and the tiles.

Two kinds of choice, kept apart because only one of them may follow the batch:

- ``Fp8Reduction`` (split-K count and MMA form) is part of every output element's summation order. It is looked
  up by the weight's shape and the device only, never by the row count, so a row's bits do not depend on the
  batch it runs in. ``TUNED_REDUCTIONS`` holds measured entries; anything missing gets ``default_reduction``.
- ``Fp8Tile`` (rows per program, K step, warps, stages) changes which programs compute an element, not how it is
  summed, so it may follow the row count: ``TUNED_TILES`` is keyed by a row bucket as well. One exception is
  the MMA instruction itself: a tile with fewer than 64 weight rows per warp group runs mma.sync instead of
  wgmma, whose bf16 chain rounds differently (seen on an H100), so a tuning run writes a bucket's tile only
  after its rows equal the same rows of the 64-row bucket.

Both tables are read from ``gemm_configs.json`` beside this module (checked in; ``benchmarks/fp8_gemm_bench.py
--tune --tune-out FILE`` writes one from timings on the device it runs on), then entry by entry from the file
named in the environment variable ``FLASHTIER_FP8_GEMM_CONFIGS`` if set (one's own tuning run), once, at
import; a malformed file raises ValueError naming it. An entry changes a GPU's results bit for bit only through
``Fp8Reduction`` (and the instruction rule above). Device keys are ``torch.cuda.get_device_name`` strings; the
CPU interpreter is keyed "cpu".

    {"reductions": [{"device": "NVIDIA H100 80GB HBM3", "n": 32768, "k": 1280, "split_k": 1, "mma": "fp8",
                     "note": "..."}],
     "tiles": [{"device": ..., "n": 32768, "k": 1280, "rows": 64, "block_m": 64, "block_n": 128, "block_k": 128,
                "num_warps": 8, "num_stages": 3, "fuse": false, "note": "..."}]}

Nothing here changes after import (the tables are module dicts: a test may patch an entry).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
import triton

MMA_FORMS = ("fp8", "bf16")
MAX_SPLIT_K = 64


@dataclass(frozen=True)
class Fp8Reduction:
    """How a weight shape's K is summed (part of the result's bits).

    ``split_k``: K ranges summed separately from zero, then added in ascending order. ``mma``: "fp8" = one fp8
    MMA per 32-block of K, scaled in fp32 and added in ascending order (the official two-level accumulation);
    "bf16" = both operands decoded to bf16 with their power-of-two scales folded in (exact), one tensor-core
    chain over the range (no per-block promotion; products exact, fp32 accumulation in the MMA).
    """

    split_k: int = 1
    mma: str = "fp8"

    def __post_init__(self) -> None:
        if isinstance(self.split_k, bool) or not isinstance(self.split_k, int) or not 1 <= self.split_k <= MAX_SPLIT_K:
            raise ValueError(f"Fp8Reduction: split_k must be an int in [1, {MAX_SPLIT_K}], got {self.split_k!r}")
        if self.mma not in MMA_FORMS:
            raise ValueError(f"Fp8Reduction: mma must be one of {MMA_FORMS}, got {self.mma!r}")


@dataclass(frozen=True)
class Fp8Tile:
    """Which programs compute what (not part of the bits): ``block_m`` activation rows (the swapped MMA's N, >= 16),
    ``block_n`` weight rows (its M), ``block_k`` K per loop step (a multiple of 32), warps and pipeline stages;
    ``fuse``: ``fp8_gemm_fused`` quantises the activation inside the GEMM's loads (one launch, every N tile
    quantising the same rows again) instead of launching ``act_quant`` first (same bits either way)."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    fuse: bool = False

    def __post_init__(self) -> None:
        pow2 = lambda v: isinstance(v, int) and v > 0 and not v & (v - 1)  # noqa: E731
        if not (pow2(self.block_m) and self.block_m >= 16 and pow2(self.block_n) and self.block_n >= 16
                and pow2(self.block_k) and self.block_k >= 32 and self.num_warps in (1, 2, 4, 8, 16)
                and isinstance(self.num_stages, int) and self.num_stages >= 1 and isinstance(self.fuse, bool)):
            raise ValueError(f"Fp8Tile: block_m, block_n >= 16, block_k >= 32 (powers of two), num_warps a power "
                             f"of two <= 16, num_stages >= 1, fuse a bool; got {self}")


TABLE = Path(__file__).with_name("gemm_configs.json")
ENV_TABLE = "FLASHTIER_FP8_GEMM_CONFIGS"
ReductionKey = tuple[str, int, int]  # (device name, N, K per group)
TileKey = tuple[str, int, int, int]  # (device name, N, K per group, row bucket = row_bucket(M))


def read_table(path: Path) -> tuple[dict[ReductionKey, Fp8Reduction], dict[TileKey, Fp8Tile]]:
    """The reductions and tiles of one table file (module docstring). Raises ValueError naming ``path`` when it
    cannot be read or an entry is malformed."""
    try:
        doc = json.loads(path.read_text())
        reductions = {(str(e["device"]), int(e["n"]), int(e["k"])): Fp8Reduction(int(e["split_k"]), str(e["mma"]))
                      for e in doc.get("reductions", [])}
        tiles = {(str(e["device"]), int(e["n"]), int(e["k"]), int(e["rows"])):
                 Fp8Tile(*(int(e[name]) for name in ("block_m", "block_n", "block_k", "num_warps", "num_stages")),
                         fuse=e.get("fuse", False)) for e in doc.get("tiles", [])}
        return reductions, tiles
    except (OSError, KeyError, TypeError, ValueError, AttributeError) as exc:
        raise ValueError(f"fp8 gemm config table {path}: {exc}") from exc


def reduction_entry(key: ReductionKey, red: Fp8Reduction, note: str) -> dict:
    """One ``reductions`` entry of a table file (what ``--tune-out`` writes)."""
    return dict(device=key[0], n=key[1], k=key[2], split_k=red.split_k, mma=red.mma, note=note)


def tile_entry(key: TileKey, tile: Fp8Tile, note: str) -> dict:
    """One ``tiles`` entry of a table file."""
    return dict(device=key[0], n=key[1], k=key[2], rows=key[3], **dataclasses.asdict(tile), note=note)


def _tables() -> tuple[dict[ReductionKey, Fp8Reduction], dict[TileKey, Fp8Tile]]:
    reductions, tiles = read_table(TABLE) if TABLE.is_file() else ({}, {})
    override = os.environ.get(ENV_TABLE)
    if override:
        more = read_table(Path(override))
        reductions.update(more[0])
        tiles.update(more[1])
    return reductions, tiles


# (device name, N, K per group) -> reduction; anything missing gets ``default_reduction``.
# (device name, N, K per group, row bucket) -> tile; anything missing gets ``tile_for``'s default.
TUNED_REDUCTIONS, TUNED_TILES = _tables()

DECODE_ROWS = 64  # up to this many rows: one M tile (the weight is read once), splits as separate programs
PREFILL_TILE = Fp8Tile(block_m=128, block_n=128, block_k=128, num_warps=8, num_stages=3)


@functools.lru_cache(maxsize=8)
def _device_facts(device: torch.device) -> tuple[str, int]:
    if device.type != "cuda":
        return "cpu", 132
    props = torch.cuda.get_device_properties(device)
    return props.name, props.multi_processor_count


def device_key(device: torch.device) -> str:
    """The tables' device key: the CUDA device name, or "cpu"."""
    return _device_facts(device)[0]


def default_split(n: int, kw: int, sm_count: int) -> int:
    """Split K until ~2 programs of 64 weight rows per SM, each split keeping >= 512 of K (4 steps of 128) so the
    pipeline fills. A function of (N, K, SM count) only."""
    tiles, split = triton.cdiv(n, 64), 1
    while tiles * split < 2 * sm_count and kw // (2 * split) >= 512:
        split *= 2
    return split


def default_reduction(n: int, kw: int, device: torch.device) -> Fp8Reduction:
    return Fp8Reduction(split_k=default_split(n, kw, _device_facts(device)[1]), mma="fp8")


def reduction_for(n: int, kw: int, device: torch.device) -> Fp8Reduction:
    """The reduction order of weight shape ``[n, kw]`` on ``device``: the tuned entry, else the default rule."""
    return TUNED_REDUCTIONS.get((device_key(device), n, kw)) or default_reduction(n, kw, device)


def row_bucket(m: int) -> int:
    """16, 32 or 64 for decode row counts (the M tile), 0 above ``DECODE_ROWS`` (prefill tiles)."""
    return 0 if m > DECODE_ROWS else max(16, triton.next_power_of_2(m))


def tile_for(m: int, n: int, kw: int, device: torch.device) -> Fp8Tile:
    """Tile shape for ``m`` rows of weight ``[n, kw]``: the tuned entry of its row bucket, else 64 weight rows x
    128 of K per step with the bucket's rows (decode), or 128 x 128 (prefill); ``act_quant`` launched first
    unless the entry fuses (never above ``DECODE_ROWS``, where every N tile would quantise the same rows)."""
    bucket = row_bucket(m)
    tuned = TUNED_TILES.get((device_key(device), n, kw, bucket))
    if tuned is not None:
        return tuned
    if bucket == 0:
        return PREFILL_TILE
    return Fp8Tile(block_m=bucket, block_n=64, block_k=128, num_warps=4, num_stages=4)
