"""The sharded forward over NCCL on 2 or 4 GPUs of one host (opt-in: ``-m gpu`` with TRITON_INTERPRET=0;
skipped without the GPUs).

Same claim as test_parallel_forward.py, on the device: every rank's sharded logits (float64 ``tiny``,
prefill of a few dozen tokens + DECODE_STEPS decode steps) equal the unsharded model's logits on the
same GPU to TOL relative, with the same greedy tokens. Exercises what gloo cannot: NCCL's collectives,
the all-to-all counts on the device, the Triton quantisation kernels inside the split layers.
"""

import os

import pytest
import torch
import torch.multiprocessing as mp

from .conftest import random_prompt, rel_err
from .parallel_worker import free_port
from .parallel_worker_gpu import rank_main

TOL = 1e-12
DECODE_STEPS = 4

CASES = {
    "tp2": (2, {"tensor_parallel_size": 2}),
    "ep2_dp2": (2, {"data_parallel_size": 2, "expert_parallel": True}),
    "tp2_ep2": (2, {"tensor_parallel_size": 2, "expert_parallel": True}),
    "tp2_dp2_ep4": (4, {"tensor_parallel_size": 2, "data_parallel_size": 2, "expert_parallel": True}),
}


@pytest.mark.gpu
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="needs compiled Triton (TRITON_INTERPRET=0)")
@pytest.mark.parametrize("case", list(CASES))
def test_sharded_logits_equal_unsharded_on_gpus(case, tmp_path):
    world, fields = CASES[case]
    if not torch.cuda.is_available() or torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} CUDA devices")
    prompts = [random_prompt(40, seed=40), random_prompt(33, seed=41)]
    mp.spawn(rank_main, args=(fields, free_port(), prompts, DECODE_STEPS, str(tmp_path)), nprocs=world, join=True)
    for rank in range(world):
        out = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)
        err = rel_err(out["sharded"], out["single"])
        print(f"{case} rank {rank}: relative error {err}")
        assert err <= TOL
        assert torch.equal(out["sharded"].argmax(-1), out["single"].argmax(-1))
