"""Launch choices of the FP8 GEMM per weight shape: the reduction order (fixed per (N, K, device)) and the tiles.

Two kinds of choice, kept apart because only one of them may follow the batch:

- ``Fp8Reduction`` (split-K count and MMA form) is part of every output element's summation order. It is looked
  up by the weight's shape and the device only, never by the row count, so a row's bits do not depend on the
  batch it runs in. ``TUNED_REDUCTIONS`` holds measured entries; anything missing gets ``default_reduction``.
- ``Fp8Tile`` (rows per program, K step, warps, stages) changes which programs compute an element, not how it is
  summed, so it may follow the row count: ``TUNED_TILES`` is keyed by a row bucket as well.

Both tables are filled from ``benchmarks/fp8_gemm_bench.py --tune`` (it prints the entries for the device it
runs on); an entry changes a GPU's results bit for bit only through ``Fp8Reduction``. Device keys are
``torch.cuda.get_device_name`` strings; the CPU interpreter is keyed "cpu". Nothing here holds state.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

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
    ``block_n`` weight rows (its M), ``block_k`` K per loop step (a multiple of 32), warps and pipeline stages."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


# (device name, N, K per group) -> reduction. Empty until a tuning run on that device fills it: the default
# rule below is what every GPU result so far was measured with.
TUNED_REDUCTIONS: dict[tuple[str, int, int], Fp8Reduction] = {}
# (device name, N, K per group, row bucket) -> tile; row bucket = row_bucket(M).
TUNED_TILES: dict[tuple[str, int, int, int], Fp8Tile] = {}

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
    128 of K per step with the bucket's rows (decode), or 128 x 128 (prefill)."""
    bucket = row_bucket(m)
    tuned = TUNED_TILES.get((device_key(device), n, kw, bucket))
    if tuned is not None:
        return tuned
    if bucket == 0:
        return PREFILL_TILE
    return Fp8Tile(block_m=bucket, block_n=64, block_k=128, num_warps=4, num_stages=4)
