"""The MoE layer's device path: experts converted to ExpertWeights, routing and experts through the kernels.

CPU (kernels interpreted): the tiny preset (64 wide, 8 experts top-2, 32-wide experts; DSpark stages 4
experts top-2). GPU (``-m gpu``): one flash-16e layer (5120 wide, 16 experts top-6, 2304-wide experts)
built on the device.

What is checked:
- conversion reaches every MoE (backbone and DSpark), is lossless for snapped weights (the converted
  layer's reference path equals the float layer bit for bit), and checkpoint bytes give the same container;
- the reference quantises the expert input and the activation before w2 to FP8 (both sites matter);
- the Triton path against the float reference (tolerance as tests/kernels/test_moe_grouped_gemm.py:
  <= 1e-6 per row but for rare single FP8 flips, none above 5e-2), and a token alone against the same
  token in a batch of 64: bit-identical;
- on the GPU also that the forward captures into a CUDA graph (no host sync) and replays the same bits.
"""

import copy
import os

import pytest
import torch

from flashtier.engine.model.config import preset
from flashtier.engine.model.expert_weights import ExpertWeights
from flashtier.engine.model.init import random_model
from flashtier.engine.model.moe import MoE
from flashtier.engine.model.moe_convert import convert_experts_
from flashtier.kernels.quant.fp8_weight import quantize_fp8_weight
from flashtier.kernels.moe.grouped_gemm_reference import expert_ffn_reference
from flashtier.kernels.quant.fp8 import fp8_qdq
from flashtier.kernels.quant.mxfp4 import quantize_mxfp4


def row_errors(ref, out):
    ref, out = ref.double().cpu(), out.double().cpu()
    return (out - ref).norm(dim=1) / ref.norm(dim=1).clamp_min(1e-30)


def assert_close_rows(ref, out, tight=1e-6, loose=5e-2):
    err = row_errors(ref, out)
    assert int((err > tight).sum()) <= 0.01 * err.numel() and float(err.max()) <= loose, f"worst row {err.max():.2e}"


@pytest.fixture(scope="module")
def model():
    return random_model(preset("tiny"), seed=3)


@pytest.fixture(scope="module")
def converted(model):
    """(float copies of two MoE layers, the model after convert_experts_ on the CPU, bytes resident)."""
    floats = {"layers.5": copy.deepcopy(model.layers[5].ffn), "mtp.1": copy.deepcopy(model.mtp[1].ffn)}
    m = copy.deepcopy(model)
    return floats, m, convert_experts_(m, "cpu")


def test_every_moe_is_converted(converted):
    _, m, nbytes = converted
    moes = [mod for mod in m.modules() if isinstance(mod, MoE)]
    assert len(moes) == 40 + 3 and all(mod.converted and mod.shared_experts is None for mod in moes)
    cfg = m.cfg
    d, i = cfg.hidden_size, cfg.moe_intermediate_size
    per_expert = 3 * d * i * 17 // 32  # half a byte per code plus one scale byte per 32
    shared = 3 * d * i + 3 * d * i // 1024
    expected = (40 * (cfg.n_routed_experts * per_expert + shared)
                + 3 * (cfg.dspark_n_routed_experts * per_expert + shared))
    assert nbytes == expected
    assert not any(".experts." in k or "shared_experts" in k for k in m.state_dict())
    assert convert_experts_(m, "cpu") == nbytes  # a second call changes nothing


@pytest.mark.parametrize("name", ["layers.5", "mtp.1"])
def test_conversion_is_lossless(converted, name):
    floats, m, _ = converted
    ref_moe = floats[name]
    moe = m.get_submodule(name + ".ffn")
    for e in range(len(ref_moe.experts)):
        for got, want in zip(moe.experts.dense_expert(e), ref_moe.experts[e].weights()):
            assert torch.equal(got, want)
    for got, want in zip(moe.experts.dense_shared(), ref_moe.shared_experts.weights()):
        assert torch.equal(got, want)
    x = torch.randn(17, m.cfg.hidden_size)
    with torch.no_grad():
        assert torch.equal(moe(x), ref_moe(x))  # the converted layer's CPU path is the reference


def test_from_packed_equals_from_float(converted):
    floats, m, _ = converted
    ref_moe = floats["layers.5"]
    packed = lambda w: quantize_mxfp4(w.detach())  # noqa: E731  (what the checkpoint stores: I8 + E8M0)
    fp8 = lambda w: quantize_fp8_weight(w.detach())  # noqa: E731
    ex = ref_moe.experts
    sh = ref_moe.shared_experts
    ew = ExpertWeights.from_packed([packed(x.w1.weight) for x in ex], [packed(x.w3.weight) for x in ex],
                                   [packed(x.w2.weight) for x in ex], (fp8(sh.w1.weight), fp8(sh.w3.weight),
                                                                        fp8(sh.w2.weight)), "cpu")
    want = m.layers[5].ffn.experts
    for (name, a), (_, b) in zip(ew.named_buffers(), want.named_buffers()):
        assert torch.equal(a, b), name
    bad = [packed(x.w1.weight) for x in ex]
    bad[2] = (bad[2][0][:, :-1], bad[2][1])
    with pytest.raises(ValueError, match=r"expert 2 w1 codes must have shape"):
        ExpertWeights.from_packed(bad, [packed(x.w3.weight) for x in ex], [packed(x.w2.weight) for x in ex],
                                  (fp8(sh.w1.weight), fp8(sh.w3.weight), fp8(sh.w2.weight)), "cpu")


def test_random_fill_is_seeded_and_scaled():
    a = ExpertWeights(4, 64, 32, 32, "cpu").random_(seed=1)
    b = ExpertWeights(4, 64, 32, 32, "cpu").random_(seed=1)
    assert all(torch.equal(x, y) for x, y in zip(a.buffers(), b.buffers()))
    w1, _, w2 = a.dense_expert(3)
    assert abs(float(w1.std()) - 64**-0.5) < 0.02 and abs(float(w2.std()) - 32**-0.5) < 0.03
    assert abs(float(a.dense_shared()[2].std()) - 32**-0.5) < 0.03


def test_reference_quantises_both_activation_sites(converted):
    """The official linear(): act_quant before w1/w3 (fp4_gemm) and before w2, after the routing weight."""
    floats, _, _ = converted
    w1, w3, w2 = (w.detach() for w in floats["layers.5"].experts[0].weights())
    x, r = 3 * torch.randn(9, w1.shape[1]), torch.rand(9)

    def official(qx, qact):
        xq = fp8_qdq(x) if qx else x
        a, b = xq @ w1.T, xq @ w3.T
        act = r[:, None] * (torch.nn.functional.silu(a.clamp(max=10.0)) * b.clamp(-10.0, 10.0))
        return (fp8_qdq(act) if qact else act) @ w2.T

    got = expert_ffn_reference(fp8_qdq(x), (w1, w3, w2), r, 10.0)
    torch.testing.assert_close(got, official(True, True), rtol=1e-6, atol=1e-6)
    for qx, qact in ((False, True), (True, False)):
        assert not torch.allclose(got, official(qx, qact), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", ["layers.5", "mtp.1"])
@pytest.mark.parametrize("n", [1, 3, 17])
def test_triton_path_matches_the_float_layer(converted, name, n):
    floats, m, _ = converted
    moe = m.get_submodule(name + ".ffn")
    x = torch.randn(n, m.cfg.hidden_size, generator=torch.Generator().manual_seed(n))
    with torch.no_grad():
        ref = floats[name](x)
        moe.experts.impl = "triton"
        try:
            out = moe(x)
        finally:
            moe.experts.impl = "auto"
    assert out.dtype == torch.float32
    assert_close_rows(ref, out)


def test_token_alone_equals_token_in_batch(converted):
    _, m, _ = converted
    moe = m.layers[9].ffn
    x = torch.randn(64, m.cfg.hidden_size, generator=torch.Generator().manual_seed(7))
    moe.experts.impl = "triton"
    try:
        with torch.no_grad():
            batch = moe(x)
            for t in (0, 50):
                assert torch.equal(moe(x[t : t + 1])[0], batch[t])
    finally:
        moe.experts.impl = "auto"


def gpu_layer(seed=0):
    """One flash-16e MoE layer built on the GPU: experts quantised there, never held in float."""
    cfg = preset("flash-16e")
    d, i, e = cfg.hidden_size, cfg.moe_intermediate_size, cfg.n_routed_experts
    g = torch.Generator(device="cuda").manual_seed(seed)
    with torch.device("meta"):
        moe = MoE(cfg, e, cfg.num_experts_per_tok, torch.float32)
    moe.gate.to_empty(device="cuda")
    moe.gate.weight.data = torch.randn(e, d, generator=g, device="cuda") / d**0.5
    moe.gate.bias.data = 0.1 * torch.randn(e, generator=g, device="cuda")
    ew = ExpertWeights(e, d, i, i * cfg.n_shared_experts, "cuda").random_(seed)
    moe.experts, moe.shared_experts = ew, None
    return moe, torch.randn(300, d, generator=g, device="cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="needs compiled Triton (TRITON_INTERPRET=0)")
def test_flash16e_layer_gpu():
    torch.backends.cuda.matmul.allow_tf32 = False
    moe, x = gpu_layer()
    with torch.no_grad():
        for n in (1, 3, 17, 64, 300):
            out = moe(x[:n])
            moe.experts.impl = "reference"
            ref = moe(x[:n])
            moe.experts.impl = "auto"
            err = row_errors(ref, out)
            assert float(err.median()) <= 1e-5 and float(err.max()) <= 5e-3, f"N={n}: {err.median()}, {err.max()}"
        batch = moe(x[:64])
        for t in (0, 17, 63):
            assert torch.equal(moe(x[t : t + 1])[0], batch[t])
        static_x = x[:8].clone()
        eager = moe(static_x)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            moe(static_x)  # warm-up outside the capture (Triton compiles on first call)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):  # fails on any host sync inside the forward
            captured = moe(static_x)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured, eager)
