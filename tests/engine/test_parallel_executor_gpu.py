"""The parallel executor over NCCL on 2 GPUs of one host (opt-in: ``-m gpu`` with TRITON_INTERPRET=0; skipped
without two CUDA devices).

Same claim as test_parallel_executor.py, on the device and through the batched forward (the engine's CUDA
path): TP 2 (and TP 2 with expert parallelism) in float64, rank r on cuda:r, gives the tokens and logprob
floats of the single-process engine on cuda:0. In bfloat16 the split changes summation orders, so the
check there is that the formats path (float weights sharded, then FP8 / MXFP4 on each device) serves
every request to its end.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os

import pytest
import torch

from flashtier.engine.config import EngineConfig
from flashtier.engine.parallel import ParallelConfig
from flashtier.engine.parallel.executor import start_engine_core

from .conftest import random_prompt
from .test_parallel_executor import GREEDY, KV, collect, sampled, single_process

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="needs compiled Triton (TRITON_INTERPRET=0)"),
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA devices"),
]

CUDA64 = EngineConfig(dtype="float64", device="cuda", max_num_batched_tokens=256)


def _requests() -> dict:
    prompts = [random_prompt(n, seed=80 + i) for i, n in enumerate((21, 34, 47, 90))]
    out = {f"greedy{i}": (p, GREEDY) for i, p in enumerate(prompts)}
    out.update({f"sampled{i}": (p, sampled(200 + i)) for i, p in enumerate(prompts)})
    return out


def _serve(parallel: ParallelConfig, config: EngineConfig, requests: dict) -> dict:
    client = start_engine_core(parallel, config, KV, seed=5, start_timeout_s=600)

    async def go():
        try:
            return await asyncio.gather(*(collect(client, rid, p, sp) for rid, (p, sp) in requests.items()))
        finally:
            await client.shutdown(10.0)

    return dict(zip(requests, asyncio.run(go())))


@pytest.mark.parametrize("fields", [{"tensor_parallel_size": 2},
                                    {"tensor_parallel_size": 2, "expert_parallel": True}], ids=["tp2", "tp2_ep2"])
def test_tp2_on_two_gpus_equals_one_gpu_in_float64(fields):
    requests = _requests()
    got = _serve(ParallelConfig(**fields), CUDA64, requests)
    want = single_process(requests, dataclasses.replace(CUDA64, device="cuda:0"))
    for rid in requests:
        assert got[rid] == want[rid], f"{rid}: {got[rid][0]} != {want[rid][0]}"


def test_tp2_serves_in_bfloat16_formats():
    requests = _requests()
    got = _serve(ParallelConfig(tensor_parallel_size=2), dataclasses.replace(CUDA64, dtype="bfloat16"), requests)
    assert all(len(tokens) == GREEDY.max_tokens for tokens, _ in got.values())
