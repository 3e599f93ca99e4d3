"""One rank's ``Engine``: this rank's part of the model, with a KV pool equal on every rank.

    checkpoint   load_rank_model: the model planned on "meta", shard_model_ on the plan, then only this
                 rank's byte ranges of the safetensors files read (rank_slices -> device_loader.load_parts_)
    demo         CPU / float64: build_model, the preset's seeded random weights, whole, then shard_model_;
                 CUDA: random_rank_model, only the rank's share drawn on its GPU in its stored formats,
                 equal to that share of one process's random_model_on_device (rank_random.py)
    Engine(model, tiers=None)    SSD tier and snapshot pool off: their lookups finish on I/O threads at
                                 times no two ranks share, so two ranks would schedule differently

A checkpoint is never materialised whole by a rank: each reads its heads' rows, vocabulary rows, expert
slices (TP) or whole experts (EP), plus the replicated tensors, straight into the formats it runs (on CUDA
in bf16 / fp32: FP8 linears as stored, the sharded experts dequantised into their float slices, as
``shard_model_``'s MoE modules compute; float64 and the CPU: float weights, the reference path). The
Engram tables are mapped from the files, one copy per host (engram_table.py). The result equals the
whole model built and then sharded, bit for bit (tests/engine/test_shard_load.py).

Every rank must get the same pool size (its scheduler's admission and preemption depend on it): when the
settings leave the pool to the free device memory, the smallest free memory over the ranks sizes every
rank's pool.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
import torch.distributed as dist

from flashtier.engine.config import EngineConfig
from flashtier.engine.engine import Engine
from flashtier.engine.factory import build_model, reserve_engram_staging
from flashtier.engine.model.config import preset
from flashtier.engine.model.device_loader import load_parts_
from flashtier.engine.model.dspark import dspark_skip
from flashtier.engine.model.loader import meta_model
from flashtier.engine.model.transformer import Transformer
from flashtier.engine.parallel.process_group import ParallelGroups
from flashtier.engine.parallel.rank_random import random_rank_model
from flashtier.engine.parallel.shard_model import rank_slices, shard_model_
from flashtier.kvstore.config import KVStoreConfig

__all__ = ["build_rank_engine", "build_rank_model", "load_rank_model", "rank_device"]


def rank_device(device: str, rank: int) -> torch.device:
    """The device of ``rank``: its own GPU (``cuda:RANK``) for ``cuda``, else ``device`` (the CPU).
    ValueError for a CUDA device with an index (each rank picks its own)."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return dev
    if dev.index is not None:
        raise ValueError(f"--device {device}: with several ranks name no index (rank r runs on cuda:r)")
    return torch.device("cuda", rank)


@torch.no_grad()
def load_rank_model(
    model_dir: str | Path, groups: ParallelGroups, device: torch.device, *, dtype: torch.dtype,
    with_dspark: bool = False, formats: bool | None = None, host_engram: bool | None = None,
    progress: bool | None = None,
) -> Transformer:
    """This rank's part of the checkpoint in ``model_dir``, read by byte range onto ``device``.

    ``formats`` (None: on for CUDA unless float64) puts the weights in their stored formats as
    ``place_in_formats_`` would (device_loader.load_parts_), else every weight is float as ``load_model``
    leaves it (float64: ``.double()`` after, as the factory does); ``host_engram`` (None: on for CUDA) maps
    the Engram tables. One progress bar, on global rank 0 (``progress`` None). Local: no collective.
    Raises CheckpointError (a ValueError) before reading anything when the checkpoint does not match.
    """
    model_dir = Path(model_dir)
    model = meta_model(model_dir, dtype, with_dspark)
    expected = {k: tuple(v.shape) for k, v in model.named_parameters()}  # the whole model, before the cut
    model = shard_model_(model, groups)
    formats = device.type == "cuda" and dtype != torch.float64 if formats is None else formats
    model = load_parts_(model, model_dir, expected, rank_slices(model), device, formats=formats,
                        host_engram=host_engram, strict=with_dspark, skip=dspark_skip(with_dspark),
                        progress=groups.rank == 0 if progress is None else progress)
    return model.double() if dtype == torch.float64 else model


@torch.no_grad()
def build_rank_model(config: EngineConfig, groups: ParallelGroups, device: torch.device) -> Transformer:
    """This rank's part of the model on ``device`` (collective for the demo weights: every rank of ``groups``
    calls it; a checkpoint is read by byte range, ``load_rank_model``)."""
    if config.model_dir is not None:
        return load_rank_model(config.model_dir, groups, device, dtype=getattr(torch, config.dtype),
                               with_dspark=config.speculative_tokens > 0)
    if device.type != "cuda" or config.dtype == "float64":  # float weights where they run: the reference path
        return shard_model_(build_model(dataclasses.replace(config, device=str(device))), groups)
    # the demo: only this rank's share drawn on its device, the values one process draws (rank_random.py)
    return random_rank_model(preset(config.preset), groups, device, seed=config.weights_seed,
                             dtype=getattr(torch, config.dtype))


def _equal_pool(kv: KVStoreConfig, device: torch.device) -> KVStoreConfig:
    """``kv`` with the pool budget every rank agrees on (collective on CUDA when the pool follows free memory)."""
    if device.type != "cuda" or kv.num_blocks is not None or kv.hbm_budget_bytes is not None:
        return kv  # a fixed size, or the CPU's fixed default: equal everywhere already
    free = torch.tensor([torch.cuda.mem_get_info(device)[0]], dtype=torch.int64, device=device)
    dist.all_reduce(free, op=dist.ReduceOp.MIN)
    return dataclasses.replace(kv, hbm_budget_bytes=max(1, int(int(free.item()) * kv.hbm_utilization)))


def build_rank_engine(config: EngineConfig, kv: KVStoreConfig, groups: ParallelGroups, device: torch.device,
                      token_map: torch.Tensor | None = None) -> Engine:
    """The rank's engine, tiers off (collective). ``config.device`` is ignored for ``device``."""
    model = build_rank_model(config, groups, device)
    reserve_engram_staging(model, config.max_num_batched_tokens)
    if token_map is not None:
        model.set_token_map(token_map.to(model.device))
    # no CUDA graphs under tensor / expert parallelism yet: capturing the step's collectives is untested
    config = dataclasses.replace(config, device=str(device), cuda_graphs=False)
    return Engine(model, config, _equal_pool(kv, device), tiers=None)
