"""Batch invariance of the kernels a row's logits go through, on the GPU, bit for bit (``-m gpu``).

For each op and real flash-16e / V4.1 shape: run ``ROWS`` rows at once, then the first ``m`` rows alone for every
``m`` of ``M_GRID`` (1 row, the 16 / 32 / 64 tile edges, the decode / prefill switch at 64, ragged counts) and
require ``torch.equal`` with the same rows of the big launch. The grid crosses every launch-shape decision an op
makes from the row count (tile width, split launch vs splits inside each program). A launch whose K split is made
to depend on the row count must fail the same comparison (``test_a_row_dependent_split_is_caught``).
"""

import functools
import os

import pytest
import torch

from flashtier.kernels.fp8_gemm.op import Fp8GemmConfig, act_quant, fp8_gemm
from flashtier.kernels.quant.fp8_weight import quantize_fp8_weight
from flashtier.kernels.invariant_linear.op import LinearConfig, linear
from flashtier.kernels.mhc.streams import hc_collapse, hc_expand
from flashtier.kernels.rms_norm.op import rms_norm
from flashtier.kernels.row_reduce.op import mean_square, row_sum

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="needs compiled Triton"),
]
ROWS = 300
M_GRID = [1, 2, 7, 16, 17, 33, 64, 65, 128, 200]

# name: (N, K, x dtype, w dtype) of the float linears
LINEARS = {
    "head-fp32x-bf16w-N129280-K4096": (129280, 4096, torch.float32, torch.bfloat16),
    "mhc-mixes-fp32-N24-K16384": (24, 16384, torch.float32, torch.float32),
    "compressor-pairs-fp32x-bf16w-N1024-K4096": (1024, 4096, torch.float32, torch.bfloat16),
    "compressor-single-bf16-N512-K4096": (512, 4096, torch.bfloat16, torch.bfloat16),
    "indexer-weights-bf16-N64-K4096": (64, 4096, torch.bfloat16, torch.bfloat16),
    "indexer-wk-bf16-N128-K512": (128, 512, torch.bfloat16, torch.bfloat16),
}
# name: (N, K activation width, groups, activation kind)
FP8 = {
    "wq_a-N1024-K4096": (1024, 4096, 1, "fp8"), "wq_b-N32768-K1024": (32768, 1024, 1, "fp8"),
    "wo_b-N4096-K8192": (4096, 8192, 1, "fp8"), "wo_a-G8-N8192-K32768-fp32a": (8192, 32768, 8, torch.float32),
}


def _rows(k: int, dtype=torch.float32, seed: int = 0) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(ROWS, k, generator=g, device="cuda").to(dtype)


def _assert_invariant(fn, x: torch.Tensor, what: str) -> None:
    full = fn(x)
    for m in M_GRID:
        part = fn(x[:m])
        assert torch.equal(part, full[:m]), f"{what}: rows of a {m}-row launch differ from the same rows of {ROWS}"


@pytest.mark.parametrize("name", list(LINEARS))
def test_linear(name):
    n, k, xd, wd = LINEARS[name]
    w = torch.randn(n, k, generator=torch.Generator(device="cuda").manual_seed(1), device="cuda").to(wd)
    _assert_invariant(lambda x: linear(x, w), _rows(k, xd), name)


@functools.lru_cache(maxsize=None)
def _fp8_weight(n: int, kw: int):
    w = torch.randn(n, kw, generator=torch.Generator(device="cuda").manual_seed(n), device="cuda")
    return quantize_fp8_weight(w, (32, 32))


@pytest.mark.parametrize("name", list(FP8))
def test_fp8_gemm(name):
    n, k, groups, kind = FP8[name]
    wq, ws = _fp8_weight(n, k // groups)

    def run(x):
        a, sa = act_quant(x) if kind == "fp8" else (x.to(kind), None)
        return fp8_gemm(a, sa, wq, ws, groups=groups)

    _assert_invariant(run, _rows(k), name)


@pytest.mark.parametrize("d", [4096, 16384, 1500])
def test_row_reductions(d):
    x = _rows(d)
    _assert_invariant(row_sum, x, f"row_sum D={d}")
    _assert_invariant(mean_square, x, f"mean_square D={d}")
    w = torch.rand(d, device="cuda") + 0.5
    _assert_invariant(lambda rows: rms_norm(rows, w, 1e-6), x, f"rms_norm D={d}")


def test_mhc_streams():
    x = _rows(4 * 4096).view(ROWS, 4, 4096)
    coeffs = torch.rand(ROWS, 4 + 4 + 16, generator=torch.Generator(device="cuda").manual_seed(2), device="cuda")
    f = _rows(4096, seed=3)
    pre, post, comb = coeffs[:, :4].contiguous(), coeffs[:, 4:8].contiguous(), coeffs[:, 8:].reshape(ROWS, 4, 4)
    full_c, full_e = hc_collapse(x, pre), hc_expand(f, x, post, comb)
    for m in M_GRID:
        assert torch.equal(hc_collapse(x[:m], pre[:m]), full_c[:m]), m
        assert torch.equal(hc_expand(f[:m], x[:m], post[:m], comb[:m]), full_e[:m]), m


def test_a_row_dependent_split_is_caught():
    # the comparison can fail: the same rows with K split 1 way alone and 8 ways in the batch
    w = torch.randn(1024, 4096, device="cuda")
    x = _rows(4096)
    alone = linear(x[:3], w, config=LinearConfig(block_m=16, block_k=32, split_k=1))
    batch = linear(x, w, config=LinearConfig(block_m=64, block_k=32, split_k=8))
    assert not torch.equal(alone, batch[:3])
    # activations over a wide range per 32-block: with one scale for all, fp8 partial sums are exact in fp32
    # and any order gives the same bits
    spread = torch.exp2(torch.randint(-12, 12, (ROWS, 128), device="cuda").float()).repeat_interleave(32, 1)
    wq, ws = _fp8_weight(1024, 4096)
    a, sa = act_quant(x * spread)
    alone = fp8_gemm(a[:3], sa[:3], wq, ws, config=Fp8GemmConfig(block_m=16, split_k=1))
    assert not torch.equal(alone, fp8_gemm(a, sa, wq, ws, config=Fp8GemmConfig(block_m=16, split_k=8))[:3])
