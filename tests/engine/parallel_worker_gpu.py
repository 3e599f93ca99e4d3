"""One rank of the multi-GPU parallel forward test (test_parallel_forward_gpu.py), started by spawn.

CUDA cannot be used in a forked child of a process that has touched it, so these ranks are spawned and
build the seeded float64 ``tiny`` model themselves. Each rank runs the UNSHARDED model on its GPU first
(the single-process logits, same device, same kernels), then shards it over NCCL and runs the same
tokens again; both logit stacks go to ``OUT_DIR/rank{R}.pt`` for the test to compare.
"""

from pathlib import Path

import torch

from flashtier.engine.model.config import preset
from flashtier.engine.model.incremental import IncrementalModel, greedy_generate
from flashtier.engine.model.init import random_model
from flashtier.engine.parallel import ParallelConfig, init_distributed, shard_model_, shutdown_distributed


@torch.no_grad()
def _logits(model, prompt: list[int], decode: list[int]) -> torch.Tensor:
    runner = IncrementalModel(model)
    state = runner.new_state()
    out = [runner.prefill(state, prompt)]
    out += [runner.decode(state, t) for t in decode]
    return torch.stack(out).cpu()


def rank_main(rank: int, fields: dict, port: int, prompts: list[list[int]], steps: int, out_dir: str,
              device_type: str = "cuda") -> None:
    config = ParallelConfig(**fields)
    device = torch.device(device_type, rank) if device_type == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    model = random_model(preset("tiny"), seed=7, dtype=torch.float64, with_dspark=False).to(device)
    prompt = prompts[rank // config.tensor_parallel_size]
    tokens, _ = greedy_generate(IncrementalModel(model), prompt, 1 + steps)
    single = _logits(model, prompt, tokens[:-1])
    groups = init_distributed(config, rank, device=device, init_method=f"tcp://127.0.0.1:{port}", timeout_s=120)
    try:
        shard_model_(model, groups)
        sharded = _logits(model, prompt, tokens[:-1])
    finally:
        shutdown_distributed()
    torch.save({"single": single, "sharded": sharded}, Path(out_dir) / f"rank{rank}.pt")
