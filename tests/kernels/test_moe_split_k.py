"""Split-K grouped MoE GEMM (``MoEGemmConfig.split_k`` > 1): partial sums, fixed-order reduction, vs the reference.

CPU grid (kernels interpreted), named ``N<tokens>-E<experts>k<top-k>-D<width>-I<inter>-s<split>[w<w2 split>]``:
tokens 1, 3, 17; K split into ragged pieces: D = 192 is 3 K steps of 64 (split 2: 2 + 1; split 3: 1 + 1 + 1),
D = 320 is 5 (split 4: 2 + 2 + 1 + an empty split), I = 96 is 1.5 steps (the second half-masked), I = 64
under split 3 is 1 + two empty splits; unused experts (one token, top-2 of 8: 6 unused) and moe_align's unused blocks;
a w2 launch left unsplit under a split w1/w3 (w1); 32-row N tiles (N1), 64-row ones with 1, 2 or 4 token tiles
per chunk (an expert with more tiles than a chunk loops over chunks).
GPU (``-m gpu``): the flash-16e geometry at 1 / 8 / 64 tokens for splits 2, 4, 8, 16.

Tolerance: the reference's (tests/kernels/test_moe_grouped_gemm.py): split-K changes only the order of the
fp32 sums (each split from zero, then the splits in ascending order), so rows match to <= 1e-6 but for
the rare activation that crosses an FP8 rounding boundary (<= 1% of rows, none above 5e-2). The w2 stage
alone has no quantisation and is held to 1e-6 on every row.
Bit-exact checks: a token alone == the same token in a batch; the same inputs twice; windows of M tiles
(a small workspace) == one window; e2m1 codes rewritten as e4m3 (value / 64) decode to
``_e2m1._e2m1_to_f32`` on every byte (bit decoder on the CPU, the hardware conversion on the GPU). A reduction
that skips a split, and a workspace the reduction reads at the wrong split, are caught.
"""

import json
import os

import pytest
import torch
import triton
import triton.language as tl

from flashtier.kernels.moe import grouped_gemm_kernel as gemm_mod
from flashtier.kernels.quant.e2m1 import _e2m1_to_f32
from flashtier.kernels.quant.fp8_bits import _e4m3_to_f32
from flashtier.kernels.moe import gemm_config
from flashtier.kernels.moe.gemm_config import MoEFfnConfig
from flashtier.kernels.moe.grouped_gemm_kernel import TOKEN_TILE, MoEGemmConfig, _e2m1_as_e4m3, launch_moe_gemm
from flashtier.kernels.moe.align import moe_align
from flashtier.kernels.moe.grouped_gemm import moe_grouped_ffn
from flashtier.kernels.moe.grouped_gemm_reference import dense_fp8_expert, dense_mxfp4_expert
from .test_moe_grouped_gemm import assert_close_rows, make_case, make_experts, row_errors

LIMIT = 10.0
NARROW = dict(block_n=32, block_k=64)
WIDE = dict(block_n=64, block_k=64)


def both(**kw) -> MoEFfnConfig:
    return MoEFfnConfig(MoEGemmConfig(**kw), MoEGemmConfig(**kw))


GRID = {  # name: (N, experts, top-k, D, I, config)
    "N1-E8k2-D192-I96-s2": (1, 8, 2, 192, 96, both(split_k=2, **NARROW)),
    "N3-E8k2-D320-I64-s4w1": (3, 8, 2, 320, 64, MoEFfnConfig(MoEGemmConfig(split_k=4, sub_tiles=2, **WIDE),
                                                           MoEGemmConfig(split_k=1, **WIDE))),
    "N17-E8k2-D192-I64-s3": (17, 8, 2, 192, 64, both(split_k=3, sub_tiles=1, **WIDE)),
}


def run(x, idx, w, routed, shared, cfg):
    return moe_grouped_ffn(x, idx, w, routed, shared, LIMIT, impl="triton", config=cfg)


@pytest.fixture(scope="module")
def grid_results():
    out = {}
    for name, (n, e, k, d, i, cfg) in GRID.items():
        routed, shared = make_experts(e, d, i, seed=n)
        x, idx, w = make_case(n, e, k, d, i, seed=n)
        ref = moe_grouped_ffn(x, idx, w, routed, shared, LIMIT, impl="reference")
        out[name] = dict(args=(x, idx, w, routed, shared), cfg=cfg, ref=ref, tri=run(x, idx, w, routed, shared, cfg))
    return out


@pytest.mark.parametrize("name", list(GRID))
def test_split_k_matches_reference(grid_results, name):
    r = grid_results[name]
    assert r["tri"].dtype == torch.float32 and r["tri"].shape == r["ref"].shape
    assert_close_rows(r["ref"], r["tri"])


def test_same_inputs_give_the_same_bits(grid_results):
    r = grid_results["N1-E8k2-D192-I96-s2"]
    assert torch.equal(run(*r["args"], r["cfg"]), r["tri"])


def test_token_alone_equals_token_in_batch(grid_results):
    r = grid_results["N17-E8k2-D192-I64-s3"]
    x, idx, w, routed, shared = r["args"]
    for t in (0, 16):
        alone = run(x[t : t + 1], idx[t : t + 1], w[t : t + 1], routed, shared, r["cfg"])
        assert torch.equal(alone[0], r["tri"][t])


def test_workspace_windows_give_the_same_bits(grid_results, monkeypatch):
    r = grid_results["N17-E8k2-D192-I64-s3"]
    windows = []
    real_reduce = gemm_mod.launch_splitk_reduce

    def counting_reduce(*args, **kwargs):
        windows.append(args[10])  # n_win
        real_reduce(*args, **kwargs)

    monkeypatch.setattr(gemm_mod, "launch_splitk_reduce", counting_reduce)
    # per M tile: 3 splits x (2 x 64 for w1/w3, 192 for w2) columns x 16 rows x 4 bytes; room for 4 w2 tiles
    monkeypatch.setattr(gemm_mod, "WORKSPACE_BYTES", 4 * 3 * 192 * 16 * 4)
    assert torch.equal(run(*r["args"], r["cfg"]), r["tri"])
    assert windows == [6, 6, 4, 4, 4]  # 12 M tiles (10 routed, 2 shared) per launch


@pytest.mark.parametrize("broken", ["skipped split", "wrong split stride"])
def test_a_broken_reduction_is_caught(grid_results, monkeypatch, broken):
    r = grid_results["N1-E8k2-D192-I96-s2"]  # 3 K steps of w1/w3: 2 + 1
    real_reduce = gemm_mod.launch_splitk_reduce

    def bad_reduce(part, *args, splits, **kwargs):
        if broken == "skipped split":
            real_reduce(part, *args, splits=splits - 1, **kwargs)
        else:  # every split read as split 0
            real_reduce(part.as_strided(part.shape, (0, *part.stride()[1:])), *args, splits=splits, **kwargs)

    monkeypatch.setattr(gemm_mod, "launch_splitk_reduce", bad_reduce)
    with pytest.raises(AssertionError, match="rows above"):
        assert_close_rows(r["ref"], run(*r["args"], r["cfg"]))


def test_w2_stage_alone_is_tight():
    """The w2 launch with split 2 (1 + a half-masked step) on given activations: only the summation order
    differs from act @ W2^T, on every row."""
    n, e, k, d, i = 9, 8, 2, 64, 96
    routed, shared = make_experts(e, d, i, seed=3)
    _, idx, _ = make_case(n, e, k, d, i, seed=3)
    cfg = MoEGemmConfig(split_k=2, sub_tiles=1)
    bm = TOKEN_TILE
    al = moe_align(idx, e, bm, impl="reference")
    n_r = al.sorted_ids.numel()
    act = torch.randn(n_r + bm * (-(-n // bm)), i).to(torch.bfloat16)
    out = launch_moe_gemm(act, torch.full((n * k + n, d), float("nan")), (routed.w2_codes, routed.w2_scales),
                          (shared.w2_codes, shared.w2_scales), gated=False, ids=al.sorted_ids,
                          block_expert=al.block_expert, first_block=al.first_block, n_tok=n, top_k=k, k_r=i, k_s=i,
                          n_r=d, n_s=d, config=cfg)
    ref = torch.empty(n * k + n, d)
    for row, f in enumerate(al.sorted_ids.tolist()):
        if f < n * k:
            ref[f] = act[row].float() @ dense_mxfp4_expert(routed, int(al.block_expert[row // bm]))[2].T
    ref[n * k :] = act[n_r : n_r + n].float() @ dense_fp8_expert(shared)[2].T
    assert float(row_errors(ref, out).max()) <= 1e-6  # also: every row written (the NaN fill is gone)


@triton.jit
def _decode_both(p_codes, p_new, p_old, HW: tl.constexpr):
    o = tl.arange(0, 256)
    c = tl.load(p_codes + o)
    if HW:  # the GEMM's compiled path: the hardware e4m3 conversion
        v = _e2m1_as_e4m3(c).to(tl.float8e4nv, bitcast=True).to(tl.float32)
    else:
        v = _e4m3_to_f32(_e2m1_as_e4m3(c).to(tl.int32))
    tl.store(p_new + o, v * 64.0)
    tl.store(p_old + o, _e2m1_to_f32(c.to(tl.int32) & 15))


def check_e2m1_decoder(device, hw):
    codes = torch.arange(256, device=device).to(torch.uint8)  # a whole byte: only the low nibble may matter
    new, old = torch.empty(256, device=device), torch.empty(256, device=device)
    _decode_both[(1,)](codes, new, old, HW=hw)
    new, old = new.cpu(), old.cpu()
    assert torch.equal(new.view(torch.int32), old.view(torch.int32))  # -0.0 included
    assert new[8].item() == 0.0 and torch.signbit(new[8]) and new[7].item() == 6.0 and new[1].item() == 0.5


def test_e2m1_as_e4m3_decodes_to_the_e2m1_values():
    check_e2m1_decoder("cpu", hw=False)


@pytest.mark.parametrize("field,value", [("split_k", 0), ("split_k", 65), ("split_k", True), ("split_k", 2.0),
                                         ("sub_tiles", 3), ("block_n", 48), ("decode", "fp8"), ("decode", None),
                                         ("pipeline", 1), ("pipeline", 7), ("pipeline", True), ("maxnreg", 100),
                                         ("maxnreg", 256), ("maxnreg", True)])
def test_bad_split_raises(field, value):
    with pytest.raises(ValueError, match=field):
        MoEGemmConfig(**{field: value})


@pytest.fixture
def fresh_table(monkeypatch):
    monkeypatch.delenv(gemm_config.ENV_TABLE, raising=False)
    gemm_config._table.cache_clear()
    yield monkeypatch
    gemm_config._table.cache_clear()


def test_checked_in_table_reads_and_an_override_replaces_one_entry(fresh_table, tmp_path):
    """Every checked-in entry is a valid config (the flash-16e shapes on an H100 take the staged loop); a file
    named by the environment variable replaces the entry it names and nothing else; a malformed one raises
    naming the file."""
    h100 = "NVIDIA H100 80GB HBM3"
    w13, w2 = gemm_config.config_for(4608, 5120, "mxfp4", h100), gemm_config.config_for(5120, 2304, "mxfp4", h100)
    assert w13.pipeline >= 2 and w2.pipeline >= 2
    assert gemm_config.config_for(4608, 5120, "mxfp4", "cpu") == gemm_config.DEFAULT
    mine = MoEGemmConfig(split_k=8, sub_tiles=1)
    entry = gemm_config.table_entry(gemm_config.ConfigKey(h100, "mxfp4", 4608, 5120), mine, "test")
    (tmp_path / "t.json").write_text(json.dumps({"entries": [entry]}))
    fresh_table.setenv(gemm_config.ENV_TABLE, str(tmp_path / "t.json"))
    gemm_config._table.cache_clear()
    assert gemm_config.config_for(4608, 5120, "mxfp4", h100) == mine
    assert gemm_config.config_for(5120, 2304, "mxfp4", h100) == w2
    entry["config"]["pipeline"] = 1
    (tmp_path / "t.json").write_text(json.dumps({"entries": [entry]}))
    gemm_config._table.cache_clear()
    with pytest.raises(ValueError, match="t.json"):
        gemm_config.config_for(4608, 5120, "mxfp4", h100)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="needs compiled Triton (TRITON_INTERPRET=0)")
@pytest.mark.parametrize("split,staged", [(2, {}), (4, {}), (8, {}), (16, {}),
                                          (4, dict(pipeline=3, sub_tiles=1)), (2, dict(pipeline=4, maxnreg=128)),
                                          (4, dict(pipeline=3, block_n=128, sub_tiles=4))])
def test_real_geometry_gpu(split, staged):
    torch.backends.cuda.matmul.allow_tf32 = False  # the reference's GEMMs in true fp32
    e, k, d, i = 16, 6, 5120, 2304
    routed, shared = make_experts(e, d, i, device="cuda")
    x, idx, w = make_case(64, e, k, d, i, device="cuda")
    cfg = both(split_k=split, **staged)
    for n in (1, 8, 64):
        out = run(x[:n], idx[:n], w[:n], routed, shared, cfg)
        ref = moe_grouped_ffn(x[:n], idx[:n], w[:n], routed, shared, LIMIT, impl="reference")
        err = row_errors(ref, out)
        assert float(err.median()) <= 1e-5 and float(err.max()) <= 5e-3, f"N={n}: {err.median():.1e} {err.max():.1e}"
        assert torch.equal(out, run(x[:n], idx[:n], w[:n], routed, shared, cfg))
    for t in (0, 63):  # batch invariance on the device
        alone = run(x[t : t + 1], idx[t : t + 1], w[t : t + 1], routed, shared, cfg)
        assert torch.equal(alone[0], out[t])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="needs compiled Triton (TRITON_INTERPRET=0)")
def test_e2m1_as_e4m3_hardware_conversion_gpu():
    check_e2m1_decoder("cuda", hw=True)
