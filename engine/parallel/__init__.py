"""Tensor, expert and data parallelism of the model over torch.distributed (NCCL on GPUs, gloo on the CPU).

    config = ParallelConfig(tensor_parallel_size=2, expert_parallel=True)
    groups = init_distributed(config, rank, device=device, init_method="env://")   # one process per rank
    shard_model_(model, groups)           # the built model keeps only this rank's part
    ... the single-process forward code, unchanged, on every rank in lockstep ...
    shutdown_distributed()
"""

from flashtier.engine.parallel.group_comm import GroupComm
from flashtier.engine.parallel.parallel_config import ParallelConfig
from flashtier.engine.parallel.process_group import (
    ParallelGroups,
    backend_for,
    init_distributed,
    shutdown_distributed,
)
from flashtier.engine.parallel.shard_model import shard_model_

# The names and modules the rest of flashtier may import (tests/test_layering.py).
__all__ = [
    "GroupComm",
    "ParallelConfig",
    "ParallelGroups",
    "backend_for",
    "init_distributed",
    "shard_model_",
    "shutdown_distributed",
    "executor",
    "parallel_attention",
    "parallel_config",
    "shard",
]
