"""Batch invariance on the GPU, bit for bit (``-m gpu``): a request's logits do not depend on its company.

tiny at the real index width, in the checkpoint formats (FP8 linears, MXFP4 routed experts: the kernels a real
checkpoint runs), bf16, CUDA graphs on (the default). Each check records one request's logits at every step it
gets a row and compares them with ``torch.equal``:

- alone vs in a batch of 8 and of 64 other requests (prefilled in the same step, decoded together: other row
  offsets, other graph buckets, other experts chosen by the neighbours);
- prefill in one step vs in chunks of 32 tokens (encoder rows split across steps: window keys read from the
  rings, ratio-2 groups completed from waiting partial groups instead of rows of the same step);
- graphs on vs off for the batch of 64 (padded replay vs eager).

A deliberately changed prompt token must break the equality (the comparison can fail). All of it holds on the
H200 (docs/perf/batch_invariance.json): every float linear, row reduction and mHC stream sum runs a kernel whose
reduction order is fixed by the weight's shape, never by the row count (kernels/invariant_linear/op.py,
row_reduce/op.py, mhc/streams.py; the FP8 GEMM's K split depends on N and K only).
"""

import os

import pytest
import torch

from flashtier.engine.config import EngineConfig
from flashtier.engine.engine import Engine
from flashtier.engine.sample.params import SamplingParams
from flashtier.kvstore.config import KVStoreConfig

from .conftest import random_prompt
from .gpu_models import tiny_on_cuda

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="needs compiled Triton"),
]
TARGET = random_prompt(100, seed=4242)
TOKENS = 8


@pytest.fixture(scope="module")
def model():
    return tiny_on_cuda("checkpoint", seed=11)


def _logits_of(model, others: int, *, budget: int = 8192, graphs: bool = True, target=TARGET) -> list[torch.Tensor]:
    cfg = EngineConfig(max_num_batched_tokens=budget, max_num_seqs=others + 1, forward="batched", dtype="bfloat16",
                       device="cuda", cuda_graphs=graphs)
    engine = Engine(model, cfg, KVStoreConfig(block_size=16, num_blocks=64 * 12 + 40))
    rows: list[torch.Tensor] = []
    execute = engine.runner.execute

    def wrapped(batch):
        out = execute(batch)
        for i, work in enumerate(batch.decoder):
            if work.request.request_id == "target":
                rows.append(out.logits[out.logit_slice(i)].float().cpu())
        return out

    engine.runner.execute = wrapped
    params = SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True)
    engine.add_request("target", list(target), params)
    for j in range(others):
        engine.add_request(f"o{j}", random_prompt(20 + 7 * j % 90, seed=900 + j), params)
    while engine.has_unfinished():
        engine.step()
    assert len(rows) == TOKENS
    return rows


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def test_alone_equals_in_a_batch(model):
    alone = _logits_of(model, 0)
    assert _same(alone, _logits_of(model, 8))
    assert _same(alone, _logits_of(model, 64))


def test_chunked_prefill_equals_one_step(model):
    assert _same(_logits_of(model, 0), _logits_of(model, 0, budget=32))


def test_graphs_equal_eager_at_batch_64(model):
    assert _same(_logits_of(model, 64, graphs=False), _logits_of(model, 64))


def test_a_changed_prompt_is_caught(model):
    changed = list(TARGET)
    changed[50] += 1
    assert not _same(_logits_of(model, 0), _logits_of(model, 0, target=changed))
