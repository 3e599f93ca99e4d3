"""The fused FP8 linear (``fp8_gemm_fused``: activation quantisation inside the GEMM's loads) on the CPU interpreter.

What must hold, and how tight:
- fused == ``act_quant`` + ``fp8_gemm`` (the two-launch path) bit for bit, for every launch form (one program
  per tile, split programs with the in-kernel ordered fix-up, splits inside a program), both MMA forms and fp32 /
  bf16 activations: the same e4m3 values meet the same MMAs in the same order (``kernel.py``);
- the reference path is ``quantize_fp8`` + ``fp8_gemm_reference`` bit for bit (it is defined so);
- against that reference: 2^-20 of sum |a*w| (fp32 summation order of the interpreter's dots, as in
  tests/kernels/test_fp8_gemm.py);
- a row's bits do not depend on the batch: rows alone (fused) == the same rows of a 70-row call (a quantise
  launch, then splits inside each program: what prefill runs).
The equality checks can fail: one activation moved by one ulp off an e4m3 rounding tie changes the output
(``test_a_one_ulp_change_at_a_tie_is_seen``). The GPU counterparts are in tests/kernels/test_fp8_gemm.py (-m gpu).
"""

import dataclasses
import json
import os
import subprocess
import sys

import pytest
import torch

from flashtier.kernels.fp8_gemm import op as op_module
from flashtier.kernels.fp8_gemm import tuning
from flashtier.kernels.fp8_gemm.kernel import fp8_gemm_triton
from flashtier.kernels.fp8_gemm.op import (
    Fp8GemmConfig, act_quant, default_config, fp8_gemm, fp8_gemm_fused, split_counters,
)
from flashtier.kernels.quant.fp8 import quantize_fp8
from flashtier.kernels.quant.fp8_weight import as_raw_bytes, quantize_fp8_weight

interp = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="CPU Triton needs TRITON_INTERPRET=1")
TOL = 2**-20


def make(m: int, n: int, k: int, seed: int = 0, dtype=torch.float32):
    """x [m, k] with every 32-block at its own magnitude (own scale), and a 32 x 32-block FP8 weight [n, k]."""
    g = torch.Generator().manual_seed(seed)
    spread = torch.exp2(torch.randint(-8, 8, (m, k // 32), generator=g).float()).repeat_interleave(32, 1)
    x = (torch.randn(m, k, generator=g) * spread).to(dtype)
    wq, ws = quantize_fp8_weight(torch.randn(n, k, generator=g), (32, 32))
    return x, wq, ws


def ties(m: int, k: int, seed: int = 0) -> torch.Tensor:
    """Activations that are exact midpoints between neighbouring e4m3 values (after the block's scale), so the
    quantiser's round-to-nearest-even decides every element; one 448 per block pins the scale to 1."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 0x7D, (m, k), generator=g, dtype=torch.uint8)
    lo = codes.view(torch.float8_e4m3fn).float()
    hi = (codes + 1).view(torch.float8_e4m3fn).float()
    x = (lo + hi) / 2 * torch.where(torch.rand(m, k, generator=g) < 0.5, -1.0, 1.0)
    x[:, ::32] = 448.0
    return x


def two_launch(x, wq, ws, cfg=None):
    a, sa = act_quant(x)
    return fp8_gemm(a, sa, wq, ws, impl="triton", config=cfg)


# (M, N, K, config): None = the shape's default launch
CASES = {
    "M1-default": (1, 40, 256, None),
    "M5-split3-launch": (5, 48, 288, Fp8GemmConfig(16, 16, 64, 3, 4, 1)),
    "M17-split2-two-m-tiles": (17, 40, 160, Fp8GemmConfig(16, 32, 64, 2, 4, 1)),
    "M33-bf16-mma-split2": (33, 64, 256, Fp8GemmConfig(64, 32, 64, 2, 4, 1, mma="bf16")),
    "M3-bf16-mma-k-tail": (3, 40, 160, Fp8GemmConfig(16, 32, 128, 1, 4, 1, mma="bf16")),
}


@interp
@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fused_equals_two_launch_bit_for_bit(name, dtype):
    m, n, k, cfg = CASES[name]
    x, wq, ws = make(m, n, k, dtype=dtype)
    fused = fp8_gemm_fused(x, wq, ws, fuse=True, impl="triton", config=cfg)
    assert torch.equal(fused, two_launch(x, wq, ws, cfg)), name
    ref = fp8_gemm_fused(x, wq, ws, impl="reference")
    a, sa = act_quant(x)
    bound = fp8_gemm(as_raw_bytes(a) & 0x7F, sa, as_raw_bytes(wq) & 0x7F, ws, impl="reference")  # sum |a*w|
    assert bool(((fused - ref).abs() <= TOL * bound).all()), f"{name}: beyond {TOL:.1e} x sum |a*w|"


@interp
def test_rounding_ties_and_bf16_output():
    x = ties(4, 128)
    _, wq, ws = make(4, 32, 128, seed=1)
    for cfg in (None, Fp8GemmConfig(16, 32, 64, 2, 4, 1, mma="bf16")):
        a, sa = act_quant(x)
        want = fp8_gemm(a, sa, wq, ws, impl="triton", config=cfg, out_dtype=torch.bfloat16)
        got = fp8_gemm_fused(x, wq, ws, fuse=True, impl="triton", config=cfg, out_dtype=torch.bfloat16)
        assert got.dtype == torch.bfloat16 and torch.equal(got, want)


@interp
def test_a_one_ulp_change_at_a_tie_is_seen():
    x = ties(2, 64, seed=2)
    _, wq, ws = make(2, 32, 64, seed=3)
    changed = []
    for toward in (float("inf"), float("-inf")):  # one ulp off the tie: one side keeps the even code, one does not
        moved = x.clone()
        moved[0, 1] = torch.nextafter(moved[0, 1], torch.tensor(toward))
        if not torch.equal(quantize_fp8(moved)[0], quantize_fp8(x)[0]):
            changed.append(moved)
    assert len(changed) == 1
    assert not torch.equal(fp8_gemm_fused(changed[0], wq, ws, fuse=True, impl="triton"), two_launch(x, wq, ws))


def test_reference_is_quantize_then_reference_gemm():
    x, wq, ws = make(6, 64, 96, seed=4)
    codes, scales = quantize_fp8(x)
    want = fp8_gemm(codes, scales, wq, ws, impl="reference")
    assert torch.equal(fp8_gemm_fused(x, wq, ws, impl="reference"), want)
    assert torch.equal(fp8_gemm_fused(x, wq, ws), want)  # "auto" on the CPU


@interp
def test_rows_do_not_depend_on_the_batch(monkeypatch):
    x, wq, ws = make(70, 40, 128, seed=5)
    # a tuned split for this shape: the split launch and its fix-up (<= 64 rows) and splits in each program (70)
    monkeypatch.setitem(tuning.TUNED_REDUCTIONS, ("cpu", 40, 128), tuning.Fp8Reduction(split_k=2))
    full = fp8_gemm_fused(x, wq, ws, fuse=False, impl="triton")  # quantise launch, splits in each program
    for m in (1, 17, 64):  # one M tile, fused
        assert torch.equal(fp8_gemm_fused(x[:m], wq, ws, fuse=True, impl="triton"), full[:m]), m


@interp
def test_counters_are_left_zeroed_and_reused(monkeypatch):
    x, wq, ws = make(3, 48, 288, seed=6)
    cfg = Fp8GemmConfig(16, 16, 64, 3, 4, 1)
    counters = split_counters(3, x.device)
    first = fp8_gemm_fused(x, wq, ws, fuse=True, impl="triton", config=cfg, counters=counters)
    assert not counters.any()
    assert torch.equal(fp8_gemm_fused(x, wq, ws, fuse=True, impl="triton", config=cfg, counters=counters), first)
    # a counter left non-zero (a launch that never finished) makes the wrong program sum, before every partial
    # is written: the check sees it. Fresh float memory is NaN here, so a partial read too early cannot equal
    # ``first`` because the allocator handed back an earlier call's workspace
    real_empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **k: (lambda t: t.fill_(float("nan")) if t.is_floating_point()
                                                         else t)(real_empty(*a, **k)))
    counters[0] = 1
    stale = torch.empty_like(first).fill_(float("nan"))
    fp8_gemm_triton(x, None, as_raw_bytes(wq), as_raw_bytes(ws), 32, 1, stale, cfg, quantize_a=True,
                    counters=counters)
    assert not torch.equal(stale, first)


def test_tuned_reduction_is_keyed_by_shape_and_device_only(monkeypatch):
    dev = torch.device("cpu")
    tuned = tuning.Fp8Reduction(split_k=3, mma="bf16")
    monkeypatch.setitem(tuning.TUNED_REDUCTIONS, ("cpu", 512, 4096), tuned)
    for m in (1, 8, 64, 300):
        cfg = default_config(m, 512, 4096, dev)
        assert (cfg.split_k, cfg.mma) == (3, "bf16"), m
    assert default_config(8, 512, 8192, dev).mma == "fp8"  # another shape: the default rule
    tile = tuning.Fp8Tile(block_m=64, block_n=128, block_k=256, num_warps=8, num_stages=3)
    monkeypatch.setitem(tuning.TUNED_TILES, ("cpu", 512, 4096, 64), tile)
    assert default_config(40, 512, 4096, dev).block_n == 128 and default_config(8, 512, 4096, dev).block_n == 64
    assert not default_config(40, 512, 4096, dev).fuse


def test_a_fused_tile_quantises_in_the_loads_for_its_bucket_only(monkeypatch):
    x, wq, ws = make(70, 40, 128, seed=8)
    monkeypatch.setitem(tuning.TUNED_TILES, ("cpu", 40, 128, 16), tuning.Fp8Tile(16, 64, 128, 4, 4, fuse=True))
    launched = []
    real = op_module.fp8_gemm_triton
    monkeypatch.setattr(op_module, "fp8_gemm_triton", lambda *a, **k: (launched.append(k.get("quantize_a", False)),
                                                                        real(*a, **k))[1])
    two = fp8_gemm_fused(x[:8], wq, ws, fuse=False, impl="triton")
    one = fp8_gemm_fused(x[:8], wq, ws, impl="triton")  # bucket 16: the table fuses
    full = fp8_gemm_fused(x, wq, ws, impl="triton")  # 70 rows: prefill, act_quant first
    assert launched == [False, True, False]
    assert torch.equal(one, two) and torch.equal(full[:8], one)


def test_checked_in_table_reads_and_entries_round_trip(tmp_path):
    reductions, tiles = tuning.read_table(tuning.TABLE)  # the checked-in table parses
    assert all(k in tuning.TUNED_REDUCTIONS for k in reductions) and all(k in tuning.TUNED_TILES for k in tiles)
    key = ("NVIDIA Test GPU", 512, 4096)
    red, tile = tuning.Fp8Reduction(split_k=4, mma="bf16"), tuning.Fp8Tile(64, 128, 64, 8, 5, fuse=True)
    path = tmp_path / "table.json"
    path.write_text(json.dumps({"reductions": [tuning.reduction_entry(key, red, "n")],
                                "tiles": [tuning.tile_entry(key + (64,), tile, "n")]}))
    assert tuning.read_table(path) == ({key: red}, {key + (64,): tile})


@pytest.mark.parametrize("doc, needle", [
    ("{", "Expecting"), ('{"reductions": [{"device": "x", "n": 1}]}', "'k'"),
    ('{"reductions": [{"device": "x", "n": 1, "k": 32, "split_k": 0, "mma": "fp8"}]}', "split_k"),
    ('{"tiles": [{"device": "x", "n": 1, "k": 32, "rows": 16, "block_m": 16, "block_n": 48, "block_k": 64, '
     '"num_warps": 4, "num_stages": 3}]}', "Fp8Tile"),
])
def test_malformed_table_raises_naming_the_file(tmp_path, doc, needle):
    path = tmp_path / "bad.json"
    path.write_text(doc)
    with pytest.raises(ValueError, match=needle) as err:
        tuning.read_table(path)
    assert str(path) in str(err.value)


def test_override_file_replaces_entries_in_a_fresh_process(tmp_path):
    key = ("cpu", 512, 4096)
    path = tmp_path / "mine.json"
    path.write_text(json.dumps({"reductions": [tuning.reduction_entry(key, tuning.Fp8Reduction(5, "bf16"), "")]}))
    code = ("import torch; from flashtier.kernels.fp8_gemm.kernel import default_config as d; "
            "c = d(8, 512, 4096, torch.device('cpu')); print(c.split_k, c.mma)")
    env = {**os.environ, tuning.ENV_TABLE: str(path)}
    out = subprocess.run([sys.executable, "-P", "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["5", "bf16"]
    env[tuning.ENV_TABLE] = str(tmp_path / "missing.json")
    bad = subprocess.run([sys.executable, "-P", "-c", code], env=env, capture_output=True, text=True)
    assert bad.returncode != 0 and "missing.json" in bad.stderr


@pytest.mark.parametrize("kw, needle", [
    (dict(split_k=0), "split_k"), (dict(split_k=65), "split_k"), (dict(mma="fp16"), "mma"),
])
def test_bad_reductions_raise(kw, needle):
    with pytest.raises(ValueError, match=needle):
        tuning.Fp8Reduction(**kw)


def test_bad_arguments_raise_value_errors_naming_them():
    x, wq, ws = make(2, 32, 64)
    with pytest.raises(ValueError, match="x must be"):
        fp8_gemm_fused(x.to(torch.float16), wq, ws)
    with pytest.raises(ValueError, match="a must be"):
        fp8_gemm_fused(x[:, :32], wq, ws)
    with pytest.raises(ValueError, match="w_scale"):
        fp8_gemm_fused(x, wq, ws[:, :1])
    with pytest.raises(ValueError, match="Fp8GemmConfig"):
        Fp8GemmConfig(block_k=48)


def gpu(fn):
    """Opt-in CUDA test: needs a device and compiled Triton (tests/conftest.py defaults TRITON_INTERPRET=1)."""
    fn = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="needs TRITON_INTERPRET=0")(fn)
    fn = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")(fn)
    return pytest.mark.gpu(fn)


# flash-16e's quantised linears (N, K): wq_a, wq_b, wkv, wo_b, indexer wq_b, Engram wkv, DSpark main_proj
GPU_SHAPES = [(1280, 5120), (32768, 1280), (512, 5120), (5120, 8192), (4096, 1280), (25600, 6144), (5120, 15360)]
GPU_ROWS = [1, 2, 8, 17, 33, 64, 65, 80]


@gpu
@pytest.mark.parametrize("mma", ["fp8", "bf16"])
@pytest.mark.parametrize("n,k", GPU_SHAPES, ids=[f"N{n}-K{k}" for n, k in GPU_SHAPES])
def test_cuda_fused_is_two_launch_and_batch_invariant(n, k, mma):
    # fused == act_quant + fp8_gemm bit for bit (both e4m3 roundings), rows alone == rows in 80 (a prefill
    # launch: act_quant first), and within tolerance of the reference: 2^-10 of sum |a*w| for the fp8 MMA (Hopper adds a
    # block's products with ~14 bits), 2^-12 for the bf16 chain.
    g = torch.Generator(device="cuda").manual_seed(n + k)
    wq, ws = quantize_fp8_weight(torch.randn(n, k, generator=g, device="cuda"), (32, 32))
    spread = torch.exp2(torch.randint(-8, 8, (80, k // 32), generator=g, device="cuda").float())
    x = torch.randn(80, k, generator=g, device="cuda") * spread.repeat_interleave(32, 1)
    x[:4] = ties(4, k).cuda()
    full = fp8_gemm_fused(x, wq, ws, config=dataclasses.replace(default_config(80, n, k, x.device), mma=mma))
    for m in GPU_ROWS:
        cfg = dataclasses.replace(default_config(m, n, k, x.device), mma=mma)
        fused = fp8_gemm_fused(x[:m], wq, ws, fuse=True, config=cfg)
        assert torch.equal(fused, full[:m]), f"rows of {m} differ from the same rows of 80"
        for quant in ("cvt", "bits"):
            a, sa = act_quant(x[:m])
            two = fp8_gemm(a, sa, wq, ws, config=dataclasses.replace(cfg, quant=quant))
            assert torch.equal(fp8_gemm_fused(x[:m], wq, ws, fuse=True, config=dataclasses.replace(cfg, quant=quant)), two)
            assert torch.equal(two, fused)
    ref = fp8_gemm_fused(x, wq, ws, impl="reference")
    a, sa = act_quant(x)
    bound = fp8_gemm(as_raw_bytes(a) & 0x7F, sa, as_raw_bytes(wq) & 0x7F, ws, impl="reference")
    tol = 2**-10 if mma == "fp8" else 2**-12
    worst = float(((full - ref).abs() / bound.clamp_min(1e-30)).max())
    assert worst <= tol, f"{worst:.2e} of sum |a*w| > {tol:.1e}"
