"""Fp8Linear (FP8 weights as stored) and quantize_linears_ (convert a model in place).

CPU: a converted layer equals the float ``nn.Linear`` path bit for bit (same act quant, the dequantised
weight is exactly the snapped one, same F.linear), so a converted tiny model's logits and DSpark drafts are
*equal* to the unconverted model's (tolerance 0), and a one-byte change of one weight scale is detected.

CUDA (``-m gpu``, TRITON_INTERPRET=0): every converted linear of tiny (incl. the grouped wo_a) applied on
the GPU against its float twin on the CPU, within 2^-10 of sum |a * w| (fp8 MMA accumulation ~2^-13, plus
e4m3 flips of act quant when the GPU and CPU inputs round differently: none here, same input). A whole-model
logits comparison is not a useful GPU test on random tiny weights: rounding every FP8 linear's output to
bf16 alone moves tiny's logits by ~70% RMS (the random 40-layer model amplifies any perturbation), so the
GPU model test checks that the converted model runs end to end with finite logits.
"""

import copy
import os

import pytest
import torch
from torch import nn

from flashtier.engine.model.dspark import dspark_propose, new_rings, seed_rings
from flashtier.engine.model.fp8_linear import Fp8Linear, act_quant, grouped_linear, linear
from flashtier.engine.model.placement import quantize_linears_
from flashtier.engine.model.reference import Plan, reference_forward
from flashtier.kernels.quant.fp8_weight import as_raw_bytes, dequantize_fp8_weight, quantize_fp8_weight

from .conftest import random_prompt


@pytest.fixture(autouse=True)
def _no_grad():
    with torch.no_grad():
        yield


def _float_layer(n: int, k: int, dtype=torch.float32, seed: int = 0) -> nn.Linear:
    g = torch.Generator().manual_seed(seed)
    layer = nn.Linear(k, n, bias=False, dtype=dtype)
    q, s = quantize_fp8_weight(torch.randn(n, k, generator=g) * 0.1)
    layer.weight.copy_(dequantize_fp8_weight(q, s).to(dtype))  # snapped, as random_model / the loader give
    return layer


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("n,k", [(96, 64), (40, 160)])  # 40: a ragged last block row
def test_fp8_linear_equals_the_float_path_bit_for_bit(dtype, n, k):
    layer = _float_layer(n, k, dtype)
    fp8 = Fp8Linear.from_float(layer.weight)
    assert fp8.weight_q.dtype == torch.float8_e4m3fn and fp8.weight_scale.shape == (-(-n // 32), k // 32)
    assert torch.equal(fp8.dequantized(), layer.weight)
    x = torch.randn(3, 5, k, dtype=torch.float64 if dtype == torch.float64 else torch.float32)
    assert torch.equal(linear(x, fp8), linear(x, layer))


def test_grouped_form_equals_the_float_einsum():
    layer = _float_layer(64, 96)  # 2 groups of 32 output rows, each reading 96 of 192 input columns
    o = torch.randn(5, 2, 96)
    assert torch.equal(grouped_linear(o, Fp8Linear.from_float(layer.weight), 2), grouped_linear(o, layer, 2))


def test_checkpoint_bytes_and_validation():
    layer = _float_layer(64, 64)
    q, s = quantize_fp8_weight(layer.weight)
    assert torch.equal(Fp8Linear(q, s).dequantized(), layer.weight)
    with pytest.raises(ValueError, match="weight_scale"):
        Fp8Linear(q, s[:1])
    with pytest.raises(ValueError, match="weight_q"):
        Fp8Linear(layer.weight, s)


@pytest.fixture(scope="module")
def converted(tiny32):
    model = copy.deepcopy(tiny32)
    names = quantize_linears_(model)
    return model, names


def test_quantize_linears_converts_every_fp8_linear_outside_the_moe(tiny32, converted):
    model, names = converted
    cfg = tiny32.cfg
    n_indexers = sum(r.role in ("full", "reindex") for r in tiny32.roles)  # 4 Full + 4 Reindex
    assert len(names) == 5 * (cfg.num_hidden_layers + len(model.mtp)) + n_indexers + len(cfg.engram_layer_ids) + 1
    assert "layers.2.attn.indexer.wq_b" in names and "layers.1.engram.wkv" in names and "mtp.0.main_proj" in names
    assert not any(".ffn." in n for n in names)
    assert isinstance(model.layers[0].ffn.shared_experts.w1, nn.Linear)  # the MoE converts its own
    keys = model.state_dict().keys()
    assert "layers.0.attn.wo_a.weight_q" in keys and "layers.0.attn.wo_a.weight" not in keys
    assert quantize_linears_(model) == []


@pytest.fixture(scope="module")
def float_logits(tiny32):
    seq = torch.tensor(random_prompt(24, seed=31))
    return seq, reference_forward(tiny32, seq, Plan.full(24, logits_from=20)).logits


def test_converted_tiny_gives_identical_logits_and_drafts(tiny32, converted, float_logits):
    model, _ = converted
    seq, want = float_logits
    assert torch.equal(reference_forward(model, seq, Plan.full(24, logits_from=20)).logits, want)
    hidden = torch.randn(6, len(tiny32.cfg.dspark_target_layer_ids), tiny32.cfg.hidden_size)
    drafts = []
    for m in (tiny32, model):
        rings = new_rings(m.cfg, len(m.mtp))
        seed_rings(m, rings, hidden, torch.arange(6))
        drafts.append(dspark_propose(m, rings, last_token=42, pos=6))
    assert torch.equal(drafts[0].logits, drafts[1].logits) and torch.equal(drafts[0].tokens, drafts[1].tokens)


def test_a_changed_weight_scale_is_detected(converted, float_logits):
    model = copy.deepcopy(converted[0])
    as_raw_bytes(model.layers[3].attn.wq_b.weight_scale)[0, 0] += 1  # one 32x32 block doubled
    seq, want = float_logits
    assert not torch.equal(reference_forward(model, seq, Plan.full(24, logits_from=20)).logits, want)


def gpu(fn):
    """Opt-in CUDA test: needs a device and compiled Triton (tests/conftest.py defaults TRITON_INTERPRET=1)."""
    fn = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="needs TRITON_INTERPRET=0")(fn)
    fn = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")(fn)
    return pytest.mark.gpu(fn)


@gpu
def test_cuda_converted_linears_match_their_float_twins(tiny32):
    model = copy.deepcopy(tiny32)
    names = quantize_linears_(model, device="cuda")
    g = torch.Generator().manual_seed(0)
    groups = tiny32.cfg.o_groups
    for name in names:
        fp8, ref = model.get_submodule(name), tiny32.get_submodule(name)
        assert fp8.weight_q.is_cuda
        x = torch.randn(17, ref.in_features, generator=g)
        w_abs = ref.weight.abs()
        if name.endswith("wo_a"):  # not quantised; fp32 activations go in as bf16 high + low parts
            x = torch.randn(17, groups, ref.in_features, generator=g)  # o [T, G, K/G]: in_features is K/G
            got, want = grouped_linear(x.cuda(), fp8, groups).cpu(), grouped_linear(x, ref, groups)
            bound = torch.einsum("tgd,grd->tgr", x.abs(), w_abs.view(groups, -1, x.shape[-1]))
        else:
            got, want = linear(x.cuda(), fp8).cpu(), linear(x, ref)
            bound = nn.functional.linear(act_quant(x).abs(), w_abs)
        assert ((got - want).abs() <= 2**-10 * bound).all(), name


@gpu
def test_cuda_converted_model_runs_end_to_end(tiny32):
    model = copy.deepcopy(tiny32)
    quantize_linears_(model, device="cuda")
    model.to("cuda")
    logits = reference_forward(model, torch.tensor(random_prompt(24, seed=31)), Plan.full(24, logits_from=20)).logits
    assert logits.is_cuda and logits.shape == (4, tiny32.cfg.vocab_size) and bool(torch.isfinite(logits).all())
