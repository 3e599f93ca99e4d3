"""``flashtier serve --device cuda`` as a real process (``-m gpu``): the engine core starts on the GPU, warms up,
and answers through the openai SDK exactly what the same checkpoint answers in-process.

No CPU test covers this: the engine core runs in its own process, and a plain ``cuda`` device (no index) there
once failed every GPU server's start (torch.cuda.set_device refuses it) while every CPU test passed. The oracle is
the offline API (``flashtier.LLM``) over the demo checkpoint the server wrote, same dtype, block size and token
budget: greedy token ids equal (the kernels are batch-invariant and the server's CUDA graphs replay the eager
step bit for bit: tests/engine/test_decode_graphs_gpu.py).
"""

from __future__ import annotations

import os

import openai
import pytest
import torch

from flashtier import LLM, SamplingParams

from ..deploy.serve_process import ServeProcess

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="needs compiled Triton"),
]

PROMPT = [(1000 + 37 * i) % 120000 for i in range(150)]
TOKENS = 8


def test_a_cuda_server_starts_warm_and_answers_like_the_engine(tmp_path):
    cache = tmp_path / "cache"
    srv = ServeProcess(cache, "--device", "cuda", "--dtype", "bfloat16", "--preset", "tiny", "--no-kv-persist",
                       "--max-num-seqs", "2", "--cuda-graph-sizes", "1,2", "--log-level", "info", timeout_s=600)
    try:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=300)
        got = client.completions.create(model="flashtier-tiny", prompt=PROMPT, max_tokens=TOKENS, temperature=0,
                                        extra_body={"ignore_eos": True, "return_token_ids": True})
        served = got.choices[0].model_extra["token_ids"]
        log = srv.log()
    finally:
        srv.stop()
    assert "warm-up" in log.lower() and "'tiny' preset" in log, log[-2000:]
    llm = LLM(str(cache / "models" / "demo-tiny-seed0"), device="cuda", dtype="bfloat16", block_size=64,
              max_num_batched_tokens=512, max_num_seqs=2)
    ref = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=TOKENS, ignore_eos=True))[0]
    assert len(served) == TOKENS and served == ref.outputs[0].token_ids
