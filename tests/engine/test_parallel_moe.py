"""Expert-parallel MoE across forked gloo ranks: data-parallel replicas with different row counts, one
of them idle (0 rows), as an executor's idle replica will call it. Each replica's output must equal the
single-process ``MoE`` on its rows to TOL relative (float64; measured 0.0: the routed experts are whole
on their owner and summed in the spec's order, the shared expert is whole at TP 1).

The grouped op's subset path (``moe_grouped_ffn(..., expert_ids=...)``), EP = 2 and 4 on a geometry with 16
experts top-4 (weights snapped to MXFP4 / FP8, so the stored form is lossless), every form in one run of the
ranks: float64 bit-identical to one process for the float experts and for the stored MXFP4 stack (the op's
reference path); float32 within F32_TOL for the float experts; the stored stack through the Triton kernels
(interpreted) within the FP4 tolerance of tests/engine/test_moe_device.py (measured 0.0 at these widths: one K
tile, so the kernels' sums fall in the reference's order); every call of the op gets exactly
the rank's experts as ``expert_ids``; a rank missing one expert is caught by the same comparison."""

import copy
import math

import pytest
import torch

from flashtier.engine.model.config import preset
from flashtier.engine.model.device_loader import place_in_formats_
from flashtier.engine.model.moe import MoE
from flashtier.engine.parallel import GroupComm, ParallelConfig, ParallelGroups, shard_model_
from flashtier.engine.parallel.expert_parallel_moe import ExpertParallelMoE
from flashtier.kernels.moe.grouped_gemm_reference import dense_mxfp4_expert
from flashtier.kernels.quant.fp8_weight import dequantize_fp8_weight, quantize_fp8_weight
from flashtier.kernels.quant.mxfp4 import mxfp4_qdq

from .conftest import rel_err
from .parallel_worker import Job, fork_ranks, free_port, moe_ep_variants_main, moe_rank_main, moe_tp_forms_main

TOL = 1e-12
F32_TOL = 1e-6  # float experts in fp32 (measured 0.0): the same math as one process, but each expert's GEMM
# runs on another batch of rows, whose blocking a BLAS may choose differently
N_EXPERTS, TOP_K = 16, 4


def _moe(seed: int) -> MoE:
    cfg = preset("tiny")
    moe = MoE(cfg, cfg.n_routed_experts, cfg.num_experts_per_tok, torch.float64).double()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in moe.named_parameters():
            std = 1.0 / math.sqrt(p.shape[-1]) if p.dim() == 2 else 0.1
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64) * std)
    return moe.eval()


@pytest.mark.parametrize("rows", [(9, 0), (5, 3), (0, 0)])
def test_expert_parallel_replicas_equal_the_moe(rows, tmp_path):
    moe = _moe(seed=3)
    d = moe.gate.weight.shape[1]
    xs = [torch.randn(n, d, dtype=torch.float64, generator=torch.Generator().manual_seed(10 + i))
          for i, n in enumerate(rows)]
    parallel = ParallelConfig(data_parallel_size=2, expert_parallel=True)
    outs = fork_ranks(moe_rank_main, (moe, xs), Job(parallel, free_port(), [], tmp_path))
    for x, y in zip(xs, outs):
        assert y.shape == x.shape and y.dtype == torch.float64
        if x.shape[0]:
            with torch.no_grad():
                want = moe(x)
            assert rel_err(y, want) <= TOL
            # a real check: another MoE's output is far away
            assert rel_err(_moe(seed=4)(x).detach(), want) > 1e-3


# ---- the grouped op's subset path --------------------------------------------------------------------------


def _snapped_moe(seed: int) -> MoE:
    """16 experts top-4 on the tiny widths (D 64, I 32), float64, routed weights snapped to MXFP4 and the shared
    expert to FP8: their stored form holds the same numbers."""
    cfg = preset("tiny")
    moe = MoE(cfg, N_EXPERTS, TOP_K, torch.float64).double()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in moe.named_parameters():
            std = 1.0 / math.sqrt(p.shape[-1]) if p.dim() == 2 else 0.1
            w = torch.randn(p.shape, generator=g, dtype=torch.float64) * std
            if ".experts." in f".{name}":
                w = mxfp4_qdq(w.float()).double()
            elif "shared_experts" in name:
                w = dequantize_fp8_weight(*quantize_fp8_weight(w.float()), impl="reference").double()
            p.copy_(w)
    return moe.eval()


EP_ROWS = {2: (9, 5), 4: (6, 0, 5, 8)}  # per DP replica; EP 4 has an idle replica


@pytest.fixture(scope="module", params=sorted(EP_ROWS))
def ep_run(request, tmp_path_factory):
    """(ep, moe, rows per replica, the dropped expert, each rank's outputs) of one forked run at EP = ep."""
    ep = request.param
    moe = _snapped_moe(seed=5)
    d = moe.gate.weight.shape[1]
    xs = [torch.randn(n, d, dtype=torch.float64, generator=torch.Generator().manual_seed(20 + i))
          for i, n in enumerate(EP_ROWS[ep])]
    with torch.no_grad():
        idx, _ = moe.route(torch.cat(xs))
    drop = int(torch.bincount(idx.reshape(-1).long(), minlength=N_EXPERTS).argmax())  # the busiest expert
    parallel = ParallelConfig(data_parallel_size=ep, expert_parallel=True)
    out_dir = tmp_path_factory.mktemp(f"ep{ep}")
    outs = fork_ranks(moe_ep_variants_main, (moe, xs, drop), Job(parallel, free_port(), [], out_dir), timeout_s=300)
    return ep, moe, xs, drop, outs


def _bit_identical(outs: list[dict], key: str, moe: MoE, xs: list[torch.Tensor]) -> bool:
    with torch.no_grad():
        return all(torch.equal(o[key], moe(x)) for o, x in zip(outs, xs))


@pytest.mark.parametrize("form", ["float64", "stored64"])
@pytest.mark.parametrize("broken", [False, True])
def test_float64_is_bit_identical_to_one_process(ep_run, form, broken):
    """float64, both expert forms: the replica outputs equal the single-process MoE bit for bit. Broken: the
    owner of the busiest expert runs without it; the same comparison must fail."""
    _, moe, xs, _, outs = ep_run
    for o, x in zip(outs, xs):
        assert o[form].shape == x.shape and o[form].dtype == torch.float64
    assert _bit_identical(outs, form + ("_broken" if broken else ""), moe, xs) is not broken


def test_float32_float_experts_within_tolerance(ep_run):
    _, moe, xs, _, outs = ep_run
    moe32 = copy.deepcopy(moe).float()
    for o, x in zip(outs, xs):
        assert o["float32"].dtype == torch.float32
        if x.shape[0]:
            with torch.no_grad():
                assert rel_err(o["float32"], moe32(x.float())) <= F32_TOL


def _row_errors(ref: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    ref, out = ref.double(), out.double()
    return (out - ref).norm(dim=1) / ref.norm(dim=1).clamp_min(1e-30)


def test_stored_experts_through_the_kernels_match_the_float_moe(ep_run):
    """The MXFP4 stack through the Triton kernels (interpreted) against the float single-process MoE: the FP4
    tolerance of tests/engine/test_moe_device.py (<= 1e-6 per row but for rare single FP8 flips, none above
    5e-2); rows routed through different kernels' sum order only."""
    _, moe, xs, _, outs = ep_run
    moe32 = copy.deepcopy(moe).float()
    errs = []
    for o, x in zip(outs, xs):
        assert o["stored32"].dtype == torch.float32 and o["stored32"].shape == x.shape
        if x.shape[0]:
            with torch.no_grad():
                errs.append(_row_errors(moe32(x.float()), o["stored32"]))
    err = torch.cat(errs)
    assert int((err > 1e-6).sum()) <= 0.01 * err.numel() + 1 and float(err.max()) <= 5e-2, f"worst {err.max():.2e}"


def test_each_rank_calls_the_grouped_op_with_its_experts(ep_run):
    """Both stored-form forwards (float64, then the kernels) call the op (the shared expert's FP8 slice on the
    rank's tokens, then the received pairs), each time with exactly the rank's experts in ascending
    global id; the bytes per expert are MXFP4's (codes half a byte, one scale per 32)."""
    ep, moe, _, _, outs = ep_run
    per_rank = N_EXPERTS // ep
    cfg = preset("tiny")
    d, i = cfg.hidden_size, cfg.moe_intermediate_size
    for r, o in enumerate(outs):
        want = torch.arange(r * per_rank, (r + 1) * per_rank)
        # 2 calls per forward, less the shared expert's on an idle replica (0 rows) and the pairs' on a rank sent none
        assert o["ids"].shape[0] >= 2 and all(torch.equal(ids, want) for ids in o["ids"])
        assert int(o["nbytes"]) == per_rank * 3 * d * i * 17 // 32


# ---- a TP group that is the EP group: the all-reduce of pairs and the all-to-all dispatch ------------------


TP_ROWS = 9


@pytest.fixture(scope="module", params=[2, 4])
def tp_run(request, tmp_path_factory):
    """(moe, the replicated rows, each rank's outputs) of one forked run at TP = EP = param."""
    tp = request.param
    moe = _snapped_moe(seed=6)
    x = torch.randn(TP_ROWS, moe.gate.weight.shape[1], dtype=torch.float64, generator=torch.Generator().manual_seed(30))
    with torch.no_grad():
        idx, _ = moe.route(x)
    drop = int(torch.bincount(idx.reshape(-1).long(), minlength=N_EXPERTS).argmax())
    parallel = ParallelConfig(tensor_parallel_size=tp, expert_parallel=True)
    out_dir = tmp_path_factory.mktemp(f"tp{tp}")
    outs = fork_ranks(moe_tp_forms_main, (moe, x, drop), Job(parallel, free_port(), [], out_dir), timeout_s=300)
    return moe, x, outs


@pytest.mark.parametrize("form", ["reduced", "all_to_all"])
def test_tp_group_forms_are_bit_identical_to_one_process(tp_run, form):
    """float64, float and stored experts, either form: every rank's output equals the single-process MoE bit
    for bit (each pair's row arrives whole; the fold is the spec's)."""
    moe, x, outs = tp_run
    with torch.no_grad():
        want = moe(x)
    for o in outs:
        assert torch.equal(o[f"{form}64"], want) and torch.equal(o[f"{form}_stored64"], want)


def test_tp_group_reduced_form_misses_a_dropped_expert(tp_run):
    moe, x, outs = tp_run
    with torch.no_grad():
        want = moe(x)
    assert not all(torch.equal(o["reduced64_broken"], want) for o in outs)


def test_reduced_form_has_no_count_exchange(tp_run):
    """The reduced form makes no all-to-all (the count exchange is a host sync on CUDA); the dispatch form makes
    its two per call."""
    _, _, outs = tp_run
    for o in outs:
        assert int(o["reduced_a2a_calls"]) == 0 and int(o["all_to_all_a2a_calls"]) >= 2


def test_tp_group_kernels_within_tolerance_in_both_forms(tp_run):
    """The MXFP4 stack through the Triton kernels (interpreted), fp32, both forms: the FP4 tolerance of
    ``test_stored_experts_through_the_kernels_match_the_float_moe``; the forms' pair rows are the same bits."""
    moe, x, outs = tp_run
    moe32 = copy.deepcopy(moe).float()
    with torch.no_grad():
        want = moe32(x.float())
    for o in outs:
        for form in ("reduced", "all_to_all"):
            err = _row_errors(want, o[f"{form}_stored32"])
            assert int((err > 1e-6).sum()) <= 0.01 * err.numel() + 1 and float(err.max()) <= 5e-2, f"{form} {err.max()}"


def test_conversion_in_place_is_lossless_and_idempotent():
    moe = _snapped_moe(seed=6).float()
    one = GroupComm((0,), 0)
    ep = ExpertParallelMoE(moe, one, one)
    floats = {e: tuple(w.detach().clone() for w in ep.experts[str(e)].weights()) for e in range(N_EXPERTS)}
    nbytes = ep.convert_experts_("cpu")
    assert ep.converted and nbytes == ep.convert_experts_("cpu")  # a second call changes nothing
    assert not any("experts." in k for k in ep.state_dict()) and ep.shared_experts is None  # floats gone
    assert ep.experts.expert_ids.tolist() == list(range(N_EXPERTS))
    for e in range(N_EXPERTS):
        for got, want in zip(dense_mxfp4_expert(ep.experts.routed(), e), floats[e]):
            assert torch.equal(got, want)
    x = torch.randn(7, moe.gate.weight.shape[1], generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(ep(x), moe(x))  # the CPU ("auto") path is the op's reference: the float layer's bits


def test_place_in_formats_converts_the_expert_parallel_blocks(tiny32):
    model = copy.deepcopy(tiny32)
    shard_model_(model, ParallelGroups.single(ParallelConfig(expert_parallel=True)))
    blocks = [m for m in model.modules() if isinstance(m, ExpertParallelMoE)]
    assert blocks and not any(b.converted for b in blocks)
    place_in_formats_(model, "cpu", host_engram=False)
    assert all(b.converted and b.experts.w13_codes.dtype == torch.uint8 for b in blocks)
