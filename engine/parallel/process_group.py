"""The default process group of a multi-rank run and the groups the sharded model talks over.

One process per rank. ``init_distributed`` starts torch.distributed with the backend the device needs
(NCCL on CUDA, gloo on the CPU), then builds this rank's groups (``ParallelGroups``)::

    rank = dp_rank * tp + tp_rank
    tp group   ranks dp_rank * tp .. dp_rank * tp + tp - 1   (attention heads, vocabulary, shared expert)
    ep group   every rank with expert_parallel, else this rank alone (routed experts, all-to-all)

``shutdown_distributed`` destroys the default group (and with it every subgroup).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from flashtier.engine.parallel.group_comm import GroupComm
from flashtier.engine.parallel.parallel_config import ParallelConfig


@dataclass(frozen=True)
class ParallelGroups:
    """This rank's place in the split: its global rank and the groups it belongs to."""

    config: ParallelConfig
    rank: int
    tp: GroupComm
    ep: GroupComm

    @property
    def tp_rank(self) -> int:
        return self.tp.index

    @property
    def dp_rank(self) -> int:
        return self.rank // self.config.tensor_parallel_size

    @staticmethod
    def single(config: ParallelConfig | None = None) -> "ParallelGroups":
        """The groups of a one-rank run (no process group needed). ValueError if ``config`` needs more ranks."""
        config = config or ParallelConfig()
        if config.world_size != 1:
            raise ValueError(f"config: a one-rank run cannot hold a world of {config.world_size} ranks")
        return ParallelGroups(config, 0, GroupComm((0,), 0), GroupComm((0,), 0))


def backend_for(device: torch.device | str) -> str:
    """The torch.distributed backend for tensors on ``device``: nccl on CUDA, gloo elsewhere."""
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def tp_group_ranks(config: ParallelConfig, dp_rank: int) -> tuple[int, ...]:
    tp = config.tensor_parallel_size
    return tuple(range(dp_rank * tp, (dp_rank + 1) * tp))


def init_distributed(
    config: ParallelConfig,
    rank: int,
    *,
    device: torch.device | str = "cpu",
    init_method: str = "env://",
    timeout_s: float = 600.0,
) -> ParallelGroups:
    """Join the default process group as ``rank`` of ``config.world_size`` and build this rank's groups.

    Every rank must call it (with equal ``config`` and ``init_method``). A world of one needs no process
    group. ``init_method`` is torch's (``env://`` reads MASTER_ADDR / MASTER_PORT; ``tcp://host:port``).
    A collective that waits longer than ``timeout_s`` raises. ValueError on a bad rank; RuntimeError if a
    default group is already running.
    """
    world = config.world_size
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world:
        raise ValueError(f"rank {rank!r} must lie in [0, world_size={world})")
    if world == 1:
        return ParallelGroups.single(config)
    if dist.is_initialized():
        raise RuntimeError("torch.distributed is already initialised in this process; call shutdown_distributed")
    dev = torch.device(device)
    kwargs = {"device_id": dev} if dev.type == "cuda" and dev.index is not None else {}
    dist.init_process_group(backend_for(dev), init_method=init_method, rank=rank, world_size=world,
                            timeout=timedelta(seconds=timeout_s), **kwargs)
    return build_groups(config, rank)


def build_groups(config: ParallelConfig, rank: int) -> ParallelGroups:
    """This rank's TP and EP groups inside the running default group (collective: every rank calls it)."""
    tp, dp = config.tensor_parallel_size, config.data_parallel_size
    world_ranks = tuple(range(config.world_size))
    tp_comm = None
    for d in range(dp):  # every rank creates every subgroup, in the same order (torch's rule)
        ranks = tp_group_ranks(config, d)
        group = dist.group.WORLD if dp == 1 else (dist.new_group(list(ranks)) if tp > 1 else None)
        if rank in ranks:
            tp_comm = GroupComm(ranks, rank, group)
    assert tp_comm is not None
    ep_comm = GroupComm(world_ranks, rank, dist.group.WORLD) if config.expert_parallel else GroupComm((rank,), rank)
    return ParallelGroups(config, rank, tp_comm, ep_comm)


def shutdown_distributed() -> None:
    """Destroy the default process group if this process runs one (idempotent)."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
