"""One rank's ``Engine``: the model built as the single-process path builds it, sharded, with an equal KV pool.

    build_model(config)          factory.py: the checkpoint, else the preset's seeded random weights
    shard_model_(model, groups)  keep this rank's heads / vocabulary / experts, insert the collectives
    Engine(model, tiers=None)    SSD tier and snapshot pool off: their lookups finish on I/O threads at
                                 times no two ranks share, so two ranks would schedule differently

On CUDA in bf16 / fp32 ``shard_model_`` needs float weights, so the model is built float (the demo's random
weights drawn on the rank's device with the single-process seed; a checkpoint read on the host), sharded,
and only then put into its stored formats on the device (the whole float model passes through one device or
the host first; reading only a rank's byte ranges of a checkpoint is a later step). Every rank must get the
same pool size (its scheduler's admission and preemption depend on it): when the settings leave the pool to
the free device memory, the smallest free memory over the ranks sizes every rank's pool.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from flashtier.engine.config import EngineConfig
from flashtier.engine.engine import Engine
from flashtier.engine.factory import build_model, reserve_engram_staging
from flashtier.engine.model.config import preset
from flashtier.engine.model.device_loader import place_in_formats_
from flashtier.engine.model.init import random_model_on_device
from flashtier.engine.model.transformer import Transformer
from flashtier.engine.parallel.process_group import ParallelGroups
from flashtier.engine.parallel.shard_model import shard_model_
from flashtier.kvstore.config import KVStoreConfig

__all__ = ["build_rank_engine", "build_rank_model", "rank_device"]


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
def build_rank_model(config: EngineConfig, groups: ParallelGroups, device: torch.device) -> Transformer:
    """This rank's part of the model on ``device`` (collective: every rank of ``groups`` calls it)."""
    if device.type != "cuda" or config.dtype == "float64":  # float weights where they run: the reference path
        return shard_model_(build_model(dataclasses.replace(config, device=str(device))), groups)
    if config.model_dir is None:  # the demo: drawn on the device as one process draws it, float until sharded
        model = random_model_on_device(preset(config.preset), device, seed=config.weights_seed,
                                       dtype=getattr(torch, config.dtype), with_dspark=False, host_engram=False)
    else:
        model = build_model(dataclasses.replace(config, device="cpu"))
    return place_in_formats_(shard_model_(model, groups), device)


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
