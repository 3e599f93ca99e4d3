"""FP8 block-scaled GEMM (kernels/fp8_gemm/op.py): the Triton kernel against the plain-torch reference.

Error metric: |y - ref| <= tol * bound elementwise, bound = the reference GEMM of |a| and |w| (the sum of
|products|, what summation error scales with). Tolerances:
- CPU (TRITON_INTERPRET=1, fp32 MMAs on decoded values): fp32 out 2^-20 (fp32 summation order only;
  measured worst 2^-22.3), bf16 out 2^-8 + 2^-20 (one bf16 rounding of y is at most half an ulp, 2^-8 |y|,
  and |y| <= bound; measured worst 2^-8.4).
- CUDA (``-m gpu``): fp8 activations 2^-12 for fp32 out (the Hopper fp8 MMA keeps ~14 bits while it adds
  a block's 32 products), bf16 activations 2^-16, fp32 activations (bf16 high + low split) 2^-14; bf16 out
  2^-8 + 2^-12 for all.
A scale byte changed by one (a factor of 2 on one block) breaks every bound: ``test_a_wrong_scale_is_detected``.
"""

import functools
import os

import pytest
import torch

from flashtier.kernels.fp8_gemm.op import Fp8GemmConfig, act_quant, fp8_gemm
from flashtier.kernels.quant.fp8_weight import as_raw_bytes, dequantize_fp8_weight, quantize_fp8_weight
from flashtier.kernels.quant.fp8 import quantize_fp8

CPU_TOL = {torch.float32: 2**-20, torch.bfloat16: 2**-8 + 2**-20}
GPU_TOL = {"fp8": 2**-10, torch.bfloat16: 2**-14, torch.float32: 2**-13, "bf16_out": 2**-8 + 2**-10}

# name: (M, N, K (activation width), block_n, groups). N and K are multiples of 32 but not of the 64/128 tiles.
SHAPES = {
    "M1-N96-K64-bn32": (1, 96, 64, 32, 1),
    "M3-N160-K96-bn1": (3, 160, 96, 1, 1),
    "M17-N40-K160-bn32": (17, 40, 160, 32, 1),  # ragged last scale row (40 = 32 + 8), K tail in a 128 step
    "M64-N224-K64-bn1": (64, 224, 64, 1, 1),
    "M300-N96-K64-bn32": (300, 96, 64, 32, 1),  # the prefill tiles
    "grouped-M5-G2-bn32": (5, 64, 192, 32, 2),
    "grouped-M17-G4-bn1": (17, 128, 256, 1, 4),
}


def make(m: int, n: int, k: int, bn: int, groups: int, a_kind, seed: int = 0):
    """CPU inputs: a (codes + scales, or floats of dtype ``a_kind``), w codes + scales."""
    g = torch.Generator().manual_seed(seed)
    # rows at very different magnitudes, so every block gets its own scale
    block_scale = torch.exp2(torch.randint(-8, 8, (m, k // 32), generator=g)).repeat_interleave(32, 1)
    x = torch.randn(m, k, generator=g) * block_scale
    w = torch.randn(n, k // groups, generator=g) * torch.exp2(torch.randint(-6, 6, (n, 1), generator=g))
    wq, ws = quantize_fp8_weight(w, (bn, 32))
    if a_kind == "fp8":
        a, sa = act_quant(x)
    else:
        a, sa = x.to(a_kind), None
    return a, sa, wq, ws


def bound(a, sa, wq, ws, bn, groups):
    """The reference GEMM of |a| and |w| (sign bits cleared)."""
    a_abs = a.abs() if sa is None else as_raw_bytes(a) & 0x7F
    return fp8_gemm(a_abs, sa, as_raw_bytes(wq) & 0x7F, ws, block_n=bn, groups=groups, impl="reference")


def assert_within(out, ref, bnd, tol, name=""):
    err = (out.float() - ref.float()).abs()
    bad = err > tol * bnd
    worst = float((err / bnd.clamp_min(1e-30)).max())
    assert not bad.any(), f"{name}: {int(bad.sum())} of {bad.numel()} beyond {tol:.1e} x bound; worst {worst:.2e}"


# every shape with fp8 and fp32 activations; bf16 activations (the wo_a dtype of the official code) on two
CASES = [(name, kind) for name in SHAPES for kind in ("fp8", torch.float32)]
CASES += [("M3-N160-K96-bn1", torch.bfloat16), ("grouped-M17-G4-bn1", torch.bfloat16)]


@pytest.mark.parametrize("name,a_kind", CASES, ids=[f"{n}-{k if isinstance(k, str) else str(k)[6:]}" for n, k in CASES])
def test_triton_matches_reference(name, a_kind):
    m, n, k, bn, groups = SHAPES[name]
    a, sa, wq, ws = make(m, n, k, bn, groups, a_kind)
    bnd = bound(a, sa, wq, ws, bn, groups)
    for out_dtype in (torch.float32, torch.bfloat16):
        ref = fp8_gemm(a, sa, wq, ws, block_n=bn, groups=groups, out_dtype=torch.float32, impl="reference")
        tri = fp8_gemm(a, sa, wq, ws, block_n=bn, groups=groups, out_dtype=out_dtype, impl="triton")
        assert tri.shape == (m, n) and tri.dtype == out_dtype
        assert_within(tri, ref, bnd, CPU_TOL[out_dtype], f"{name} {a_kind} -> {out_dtype}")


SPLITS = [Fp8GemmConfig(16, 32, 64, 2, 4, 1), Fp8GemmConfig(32, 16, 32, 3, 4, 1)]


@pytest.mark.parametrize("cfg", SPLITS, ids=["split2", "split3"])
def test_split_k_and_small_tiles(cfg):
    m, n, k, bn, groups = SHAPES["M17-N40-K160-bn32"]
    a, sa, wq, ws = make(m, n, k, bn, groups, "fp8", seed=1)
    ref = fp8_gemm(a, sa, wq, ws, block_n=bn, impl="reference")
    tri = fp8_gemm(a, sa, wq, ws, block_n=bn, impl="triton", config=cfg)
    assert_within(tri, ref, bound(a, sa, wq, ws, bn, groups), CPU_TOL[torch.float32], str(cfg))
    assert torch.equal(tri, fp8_gemm(a, sa, wq, ws, block_n=bn, impl="triton", config=cfg))  # deterministic


def test_reference_by_hand():
    # a = 1.0 everywhere with block scales 1, 2; w = 1.0 with block scales 4, 8: y = 32*1*4 + 32*2*8 = 640
    a = torch.full((2, 64), 1.0).to(torch.float8_e4m3fn)
    sa = torch.tensor([[1.0, 2.0]] * 2).to(torch.float8_e8m0fnu)
    w = torch.full((32, 64), 1.0).to(torch.float8_e4m3fn)
    sw = torch.tensor([[4.0, 8.0]]).to(torch.float8_e8m0fnu)
    for impl in ("reference", "triton"):
        assert torch.equal(fp8_gemm(a, sa, w, sw, impl=impl), torch.full((2, 32), 640.0))
    # row scales (block_n = 1): row r of w scaled by 2^r
    sw1 = torch.exp2(torch.arange(32.0))[:, None].expand(32, 2).contiguous().to(torch.float8_e8m0fnu)
    want = (32 * 1 + 32 * 2) * torch.exp2(torch.arange(32.0)).expand(2, 32)
    for impl in ("reference", "triton"):
        assert torch.equal(fp8_gemm(a, sa, w, sw1, block_n=1, impl=impl), want)


@pytest.mark.parametrize("name", ["M3-N160-K96-bn1", "grouped-M5-G2-bn32"])
def test_reference_equals_dequantised_linear(name):
    m, n, k, bn, groups = SHAPES[name]
    a, sa, wq, ws = make(m, n, k, bn, groups, "fp8", seed=2)
    a_val = a.float() * sa.float().repeat_interleave(32, 1)
    w_val = dequantize_fp8_weight(wq, ws, (bn, 32))
    ng, kw = n // groups, k // groups
    want = torch.cat([a_val[:, i * kw:(i + 1) * kw] @ w_val[i * ng:(i + 1) * ng].T for i in range(groups)], 1)
    ref = fp8_gemm(a, sa, wq, ws, block_n=bn, groups=groups, impl="reference")
    assert_within(ref, want, bound(a, sa, wq, ws, bn, groups), CPU_TOL[torch.float32], name)


def test_a_wrong_scale_is_detected():
    m, n, k, bn, groups = SHAPES["M3-N160-K96-bn1"]
    a, sa, wq, ws = make(m, n, k, bn, groups, "fp8", seed=3)
    ref = fp8_gemm(a, sa, wq, ws, block_n=bn, impl="reference")
    broken = ws.clone()
    as_raw_bytes(broken)[7, 1] += 1
    tri = fp8_gemm(a, sa, wq, broken, block_n=bn, impl="triton")
    with pytest.raises(AssertionError, match="beyond"):
        assert_within(tri, ref, bound(a, sa, wq, ws, bn, groups), CPU_TOL[torch.float32])


def test_act_quant_is_quantize_fp8_in_float8_dtypes():
    x = torch.randn(5, 96)
    codes, scales = act_quant(x)
    want_c, want_s = quantize_fp8(x)
    assert codes.dtype == torch.float8_e4m3fn and scales.dtype == torch.float8_e8m0fnu
    assert torch.equal(codes.view(torch.uint8), want_c) and torch.equal(scales.view(torch.uint8), want_s)


def test_empty_batch():
    a, sa, wq, ws = make(1, 64, 64, 32, 1, "fp8")
    assert fp8_gemm(a[:0], sa[:0], wq, ws, impl="triton").shape == (0, 64)


def test_bad_arguments_raise_value_errors_naming_them():
    a, sa, wq, ws = make(2, 64, 64, 32, 1, "fp8")
    cases = {
        "block_n": dict(block_n=16),
        "groups": dict(groups=0),
        "out_dtype": dict(out_dtype=torch.float16),
        "impl": dict(impl="cuda"),
    }
    for word, kw in cases.items():
        with pytest.raises(ValueError, match=word):
            fp8_gemm(a, sa, wq, ws, **kw)
    with pytest.raises(ValueError, match="w_scale"):
        fp8_gemm(a, sa, wq, ws[:1])
    with pytest.raises(ValueError, match="a_scale"):
        fp8_gemm(a, sa[:, :1], wq, ws)
    with pytest.raises(ValueError, match="a must be"):
        fp8_gemm(a.float(), sa, wq, ws)  # float activations take no scales
    with pytest.raises(ValueError, match="a must be"):
        fp8_gemm(a[:, :32], sa[:, :1], wq, ws)
    with pytest.raises(ValueError, match="groups"):
        fp8_gemm(torch.randn(2, 192), None, wq, ws, groups=3)  # 64 weight rows do not split in 3
    with pytest.raises(ValueError, match="w must be"):
        fp8_gemm(a, sa, wq[:, :48], ws)


def gpu(fn):
    """Opt-in CUDA test: needs a device and compiled Triton (tests/conftest.py defaults TRITON_INTERPRET=1)."""
    fn = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="needs TRITON_INTERPRET=0")(fn)
    fn = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")(fn)
    return pytest.mark.gpu(fn)


# The V4.1 linears (model.md §4) and V4-Flash's, with the wo_a groups and a 1x32-scaled expert-like weight.
GPU_SHAPES = {
    "wq_a-N1280-K5120": (1280, 5120, 32, 1), "wq_b-N32768-K1280": (32768, 1280, 32, 1),
    "wkv-N512-K5120": (512, 5120, 32, 1), "wo_b-N5120-K8192": (5120, 8192, 32, 1),
    "idx_wq_b-N4096-K1280": (4096, 1280, 32, 1), "engram_wkv-N25600-K6144": (25600, 6144, 32, 1),
    "main_proj-N5120-K15360": (5120, 15360, 32, 1), "wo_a-G8-N8192-K32768": (8192, 32768, 32, 8),
    "v4_wq_a-N1024-K4096": (1024, 4096, 32, 1), "v4_wq_b-N32768-K1024": (32768, 1024, 32, 1),
    "v4_wkv-N512-K4096": (512, 4096, 32, 1), "v4_wo_b-N4096-K8192": (4096, 8192, 32, 1),
    "expert_w1_rows-N2304-K5120": (2304, 5120, 1, 1),
}


@functools.lru_cache(maxsize=None)  # every weight once (~0.6 GB on the GPU in all)
def _gpu_weight(n: int, k: int, bn: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(n + k)
    w = torch.randn(n, k, generator=g).cuda() * torch.exp2(torch.randint(-6, 6, (n, 1), generator=g)).cuda()
    return quantize_fp8_weight(w, (bn, 32))  # Triton on CUDA


@gpu
@pytest.mark.parametrize("m", [1, 3, 17, 64, 300, 2048])
@pytest.mark.parametrize("shape", list(GPU_SHAPES))
def test_cuda_real_shapes(shape, m):
    torch.backends.cuda.matmul.allow_tf32 = False
    n, k, bn, groups = GPU_SHAPES[shape]
    wq, ws = _gpu_weight(n, k // groups, bn)
    g = torch.Generator().manual_seed(m)
    x = (torch.randn(m, k, generator=g) * torch.exp2(torch.randint(-8, 8, (m, 1), generator=g))).cuda()
    kinds = ["fp8"] + ([torch.float32, torch.bfloat16] if groups > 1 or m == 17 else [])
    for a_kind in kinds:
        a, sa = act_quant(x) if a_kind == "fp8" else (x.to(a_kind), None)
        ref = fp8_gemm(a, sa, wq, ws, block_n=bn, groups=groups, impl="reference")
        bnd = bound(a, sa, wq, ws, bn, groups)
        for out_dtype in (torch.float32, torch.bfloat16):
            out = fp8_gemm(a, sa, wq, ws, block_n=bn, groups=groups, out_dtype=out_dtype)
            tol = GPU_TOL["bf16_out"] if out_dtype == torch.bfloat16 else GPU_TOL[a_kind]
            assert_within(out, ref, bnd, tol, f"{shape} M={m} {a_kind} -> {out_dtype}")
