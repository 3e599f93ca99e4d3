"""FP8 activation quantisation exactly where the official V4.1 code runs it (issue 11 item 2).

The official ``linear()`` runs ``act_quant(x, 32, "ue8m0")`` before every GEMM with an fp8 weight (attention
wq_a, wq_b, wkv, wo_b; indexer wq_b; Engram wkv; DSpark main_proj; experts: moe.py's own tests) and never
before a bf16/fp32 weight (wo_a, indexer weights_proj / wk, compressor wkv / wgate, gate, heads).

1. ``fp8_qdq`` (the engine's act quant) is bit-identical to the official rule, written here independently
   (fp32 amax, floor 1e-4, s = 2^ceil(log2(amax * fp32(1/448))) via frexp, clamp, RNE e4m3 cast), on a grid
   with exact ties and amax at scale boundaries; and a deliberately wrong quantiser fails that comparison.
2. Each site's output equals an explicit formula with act quant at exactly the official sites (float64
   models: <= 1e-12 relative), and differs from the same formula with any single site's quant removed or
   a non-site's quant added (by > 1e-4 relative), so deleting one site's quantisation fails a test.
"""

import types

import pytest
import torch
import torch.nn.functional as F

from flashtier.engine.model.attention import Attention
from flashtier.engine.model.compressor import Compressor
from flashtier.engine.model.config import preset
from flashtier.engine.model.dspark import DSparkStage, new_rings, seed_rings
from flashtier.engine.model.engram import Engram
from flashtier.engine.model.fp8_linear import act_quant
from flashtier.engine.model.indexer import Indexer
from flashtier.engine.model.numerics import qdq
from flashtier.kernels.quant.fp8 import fp8_qdq
from flashtier.kernels.quant.mxfp4 import mxfp4_qdq

EXACT, MOVED = 1e-12, 1e-4
CFG = preset("tiny")
F64 = torch.float64


def official_act_quant(x: torch.Tensor, round_scale_up: bool = True) -> torch.Tensor:
    """The official act_quant + dequant per 32 along the last dim, in fp32, by a different route than the kernel."""
    v = x.float().reshape(*x.shape[:-1], -1, 32)
    amax = v.abs().amax(-1, keepdim=True).clamp_min(1e-4)
    ratio = amax * torch.tensor(1 / 448, dtype=torch.float32)  # the kernel multiplies by fp32(1/448)
    mant, exp = torch.frexp(ratio)  # ratio = mant * 2^exp, mant in [0.5, 1)
    exp = torch.where(mant == 0.5, exp - 1, exp) if round_scale_up else torch.round(torch.log2(ratio)).int()
    s = torch.ldexp(torch.ones_like(ratio), exp)
    q = (v / s).clamp(-448, 448).to(torch.float8_e4m3fn).float()
    return (q * s).reshape(x.shape)


def _grid() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    e4m3 = torch.arange(0, 0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    mids = (e4m3[1:] + e4m3[:-1]) / 2  # exact ties between neighbouring e4m3 values (RNE decides)
    ties = torch.cat([mids, -mids, mids[:27]]).view(-1, 31)  # 9 rows of 31, each with 448 added: s = 1
    boundary = 448 * torch.exp2(torch.arange(-20, 20).float())
    ulp = torch.tensor([1 - 2**-24, 1.0, 1 + 2**-23])  # amax just below, at and just above 448 * 2^k
    rows = [
        torch.randn(64, 32, generator=g) * torch.exp2(torch.randint(-30, 30, (64, 1), generator=g).float()),
        torch.cat([ties, torch.full((ties.shape[0], 1), 448.0)], 1),
        torch.cat([ties * 2.0**-9, torch.full((ties.shape[0], 1), 448.0 * 2**-9)], 1),
        torch.cat([(boundary[:, None] * ulp).reshape(-1, 1), torch.rand(120, 31, generator=g)], 1),
        torch.zeros(2, 32),
        torch.full((1, 32), 1e-30),
    ]
    return torch.cat(rows)


def test_fp8_qdq_is_bit_identical_to_the_official_act_quant():
    x = _grid()
    want = official_act_quant(x)
    assert torch.equal(fp8_qdq(x, impl="reference"), want)
    assert torch.equal(fp8_qdq(x, impl="triton"), want)  # interpreted on the CPU
    assert torch.equal(act_quant(x.double()), want.double())  # float64 mode goes through numerics.qdq
    xb = x.clamp(-1e30, 1e30).to(torch.bfloat16)
    assert torch.equal(fp8_qdq(xb, impl="reference"), official_act_quant(xb))


def test_the_bit_identity_check_detects_a_wrong_scale_rule():
    x = _grid()
    assert not torch.equal(fp8_qdq(x, impl="reference"), official_act_quant(x, round_scale_up=False))


def _lin(x: torch.Tensor, layer, quant: bool) -> torch.Tensor:
    return F.linear(act_quant(x) if quant else x, layer.weight)


def _check(out: torch.Tensor, formula, n_sites: int, extra: list | None = None) -> None:
    """``out`` equals formula(all sites quantised) and differs from every single-site change."""
    rel = lambda a, b: float((a - b).abs().max() / b.abs().max())  # noqa: E731
    assert rel(out, formula(*[True] * n_sites)) <= EXACT
    for i in range(n_sites):
        flags = [True] * n_sites
        flags[i] = False
        assert rel(out, formula(*flags)) > MOVED, f"site {i}: removing its act quant went unnoticed"
    for wrong in extra or []:
        assert rel(out, wrong()) > MOVED


@pytest.fixture(autouse=True)
def _no_grad():
    with torch.no_grad():
        yield


@pytest.fixture(scope="module")
def attn():
    torch.manual_seed(1)
    return Attention(CFG, CFG.layer_roles()[2], F64).double()  # a Full layer: compressor + indexer


def test_attention_queries_quantise_wq_a_and_wq_b_inputs(attn):
    h, pos = torch.randn(7, CFG.hidden_size, dtype=F64), torch.arange(7)
    q, qr = attn.project_q(h, pos)

    def formula(at_a, at_b):
        r = attn.q_norm(_lin(h, attn.wq_a, at_a))
        return attn.rope.apply(_lin(r, attn.wq_b, at_b).view(7, attn.n_heads, -1), pos)

    _check(q, formula, 2)


def test_attention_window_kv_quantises_wkv_input(attn):
    h, pos = torch.randn(5, CFG.hidden_size, dtype=F64), torch.arange(3, 8)
    _check(attn.project_kv_raw(h, pos), lambda at: attn.rope.apply(attn.kv_norm(_lin(h, attn.wkv, at)), pos), 1)


def test_attention_output_quantises_wo_b_input_but_not_wo_a(attn):
    o, pos = torch.randn(6, attn.n_heads, attn.head_dim, dtype=F64), torch.arange(6)
    g = attn.groups
    wa = attn.wo_a.weight.view(g, -1, attn.n_heads * attn.head_dim // g)

    def formula(at_b, at_a=False):
        u = attn.rope.apply(o, pos, inverse=True).reshape(6, g, -1)
        y = torch.einsum("tgd,grd->tgr", act_quant(u) if at_a else u, wa)
        return _lin(y.reshape(6, -1), attn.wo_b, at_b)

    _check(attn.output(o, pos), formula, 1, extra=[lambda: formula(True, True)])


def test_indexer_quantises_wq_b_input_but_not_weights_proj():
    torch.manual_seed(2)
    idx = Indexer(CFG, is_kv_source=True, dtype=F64).double()
    qr, h, pos = torch.randn(4, CFG.q_lora_rank, dtype=F64), torch.randn(4, CFG.hidden_size, dtype=F64), torch.arange(4)
    q, w = idx.project_q(qr, h, pos)
    _check(q, lambda at: qdq(mxfp4_qdq, idx.rope.apply(_lin(qr, idx.wq_b, at).view(4, idx.n_heads, -1), pos)), 1)
    assert torch.equal(w, F.linear(h, idx.weights_proj.weight) * idx.weight_scale)  # bf16 weight: no act quant


def test_engram_quantises_wkv_input():
    torch.manual_seed(3)
    eng = Engram(CFG, CFG.engram_layer_ids[0], F64).double()
    torch.nn.init.normal_(eng.embed.weight)
    h = torch.randn(5, CFG.hc_mult, CFG.hidden_size, dtype=F64)
    ids = torch.randint(0, 1000, (5, CFG.engram_max_ngram_size))
    e = eng.embed.weight[eng.rows(ids)].reshape(5, -1)

    def formula(at):
        kv = _lin(e, eng.wkv, at)
        split = CFG.hc_mult * CFG.hidden_size
        key, value = kv[:, :split].view(5, CFG.hc_mult, -1), kv[:, split:]
        rh, rk = torch.rsqrt(h.pow(2).mean(-1) + CFG.rms_norm_eps), torch.rsqrt(key.pow(2).mean(-1) + CFG.rms_norm_eps)
        dot = (h * eng.q_weight * eng.k_weight * key).sum(-1) * rh * rk / CFG.hidden_size**0.5
        gate = torch.sigmoid(torch.sign(dot) * torch.sqrt(dot.abs().clamp(min=1e-6)))
        return h + gate[..., None] * value[:, None, :]

    _check(eng(h, ids), formula, 1)


def test_dspark_main_proj_quantises_its_input():
    torch.manual_seed(4)
    stage = DSparkStage(CFG, 0, 1, F64).double()
    model = types.SimpleNamespace(mtp=[stage], cfg=CFG)
    hidden, pos = torch.randn(3, len(CFG.dspark_target_layer_ids), CFG.hidden_size, dtype=F64), torch.arange(10, 13)
    rings = new_rings(CFG, 1)
    rings.kv[0] = rings.kv[0].double()
    seed_rings(model, rings, hidden, pos)

    def formula(at):
        main_x = stage.main_norm(_lin(hidden.flatten(1), stage.main_proj, at))
        return stage.attn.project_kv(stage.attn_norm(main_x), pos)

    _check(rings.kv[0][pos % CFG.sliding_window], formula, 1)


def test_compressor_projections_are_not_quantised():
    torch.manual_seed(5)
    h = torch.randn(4, CFG.hidden_size, dtype=F64)
    for ratio in (1, 2):
        comp = Compressor(CFG, ratio, F64).double()

        def formula(at):
            kv = _lin(h, comp.wkv, at)
            if ratio == 1:
                return comp.norm(kv)
            z = _lin(h, comp.wgate, at)
            return comp.norm((torch.softmax(z.view(2, 2, -1), 1) * kv.view(2, 2, -1)).sum(1))

        latents, _, _ = comp.latents(h, torch.arange(4), None)
        rel = lambda a, b: float((a - b).abs().max() / b.abs().max())  # noqa: E731
        assert rel(latents, formula(False)) <= EXACT
        assert rel(latents, formula(True)) > MOVED
