"""Two conventions taken from the official DeepSeek code and pinned here: the FP4 byte of -0.0 and top-k ties.

FP4 / MXFP4 sign of zero. The official quantiser (``fp4_quant_kernel`` in ``inference/kernel.py``; V4-Flash
copy lines 169-177) stores ``T.Cast(FP4, clamp(x / s, -6, 6))``, which TileLang lowers to CUDA's
``__nv_cvt_float_to_fp4``: zero and underflow give magnitude 0 and the input's sign bit is ORed in, so -0.0
and every negative value that rounds to zero are code 0x8 (``kernels/quant/e2m1.py`` has the full citation).

Top-k ties. The official indexer (V4.1 ``inference/model.py``, ``Indexer.forward``) selects with
``index_score.topk(topk, dim=-1, sorted=False).indices.sort(dim=-1).values`` and layer 20 its blocks with
``scores.topk(min(topk_blocks, num_blocks), dim=-1)`` in ``select_candidate_blocks``; the reference runs on
the GPU (``generate.py`` sets the default device to CUDA), so the order is PyTorch's CUDA top-k: every value
above the k-th, then the values equal to it in index order (``gatherTopK`` in ``TensorTopK.cu``, single- and
multi-block; slices >= 100,000 long in <= 10 rows go through a stable radix sort instead, same result). That is
"ties to the lower index", what the references and kernels do. One difference: CUDA's radix order puts +0.0
above -0.0, which our references treat as equal; in the model every zero score of one query has the same sign
(sum_h w_h * relu(d) is -0.0 only when all of that query's w_h < 0), so it never decides a selection.

CPU tests pin our side; the ``gpu`` tests run the official call on CUDA against it.
"""

import os

import pytest
import torch

from flashtier.engine.model.indexer import candidate_pool, select_topk
from flashtier.kernels.quant.e2m1 import e2m1_codes
from flashtier.kernels.indexer_topk.reference import candidate_blocks_reference, select_topk_reference
from flashtier.kernels.quant.fp4 import dequantize_fp4, quantize_fp4
from flashtier.kernels.quant.mxfp4 import dequantize_mxfp4, quantize_mxfp4

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

# One 32-element block with amax 6 (scale 1 for both formats): element i and its official e2m1 code.
ZEROS = [(-0.0, 0x8), (-0.1, 0x8), (-0.25, 0x8), (-1e-30, 0x8), (-0.2500001, 0x9), (0.0, 0x0), (0.1, 0x0),
         (0.25, 0x0), (6.0, 0x7), (-6.0, 0xF)]


def zero_block() -> tuple[torch.Tensor, list[int]]:
    x = torch.zeros(1, 32)
    x[0, : len(ZEROS)] = torch.tensor([v for v, _ in ZEROS])
    x[0, len(ZEROS):] = -0.0
    return x, [c for _, c in ZEROS] + [0x8] * (32 - len(ZEROS))


def nibbles(packed: torch.Tensor) -> list[int]:
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten().tolist()


@pytest.mark.parametrize("quantize", [quantize_fp4, quantize_mxfp4], ids=["fp4", "mxfp4"])
@pytest.mark.parametrize("impl", ["reference", "triton"])
def test_negative_zero_and_underflow_from_below_are_code_8(quantize, impl):
    x, codes = zero_block()
    packed, scales = quantize(x, impl=impl)
    # s = 1 (fp4's second block of 16 is all -0.0: its scale is the floor, 2^-9)
    assert scales.tolist() == ([[0x38, 0x01]] if quantize is quantize_fp4 else [[127]])
    assert nibbles(packed) == codes


def test_the_codes_test_catches_an_x_below_zero_sign_rule():
    """The sign rule the quantisers used before (``x < 0``) writes 0x0 for -0.0: the byte test above sees it."""
    x, codes = zero_block()
    old = e2m1_codes(x, x < 0).flatten().tolist()
    assert old[0] == 0x0 and codes[0] == 0x8 and old != codes
    assert e2m1_codes(x, torch.signbit(x)).flatten().tolist() == codes


@pytest.mark.parametrize("fmt", ["fp4", "mxfp4"])
@pytest.mark.parametrize("impl", ["reference", "triton"])
def test_negative_zero_survives_decode_and_re_encode(fmt, impl):
    """Code 8 decodes to -0.0 and -0.0 encodes to code 8, so a record read back and quantised again (a cache
    copy, a resume) keeps its negative zeros; +0.0 stays code 0."""
    quantize, dequantize = (quantize_fp4, dequantize_fp4) if fmt == "fp4" else (quantize_mxfp4, dequantize_mxfp4)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(64, 128, generator=g) * torch.exp2(torch.randint(-8, 8, (64, 1), generator=g).float())
    x[::3, ::5] = -0.0
    x[1::3, ::7] = 0.0
    decoded = dequantize(*quantize(x, impl=impl), impl=impl)
    codes = torch.tensor(nibbles(quantize(decoded, impl=impl)[0])).view(decoded.shape)
    neg_zero = torch.signbit(decoded) & (decoded == 0)
    assert int(neg_zero.sum()) > 100 and bool(((decoded == 0) & ~neg_zero).any())
    assert torch.equal(codes == 0x8, neg_zero)


def crafted_tie() -> tuple[torch.Tensor, int, list[int]]:
    """Scores with a run of equal values straddling the k-th place, and the official pick (ascending)."""
    s = torch.tensor([[0.5, 3.0, 2.0, 2.0, 9.0, 2.0, 2.0, -1.0, 2.0, float("-inf")]])
    return s, 4, [1, 2, 3, 4]  # 9 and 3 win outright; two of the five 2.0s: the lowest indices 2 and 3


def test_tie_order_is_lower_index_first_in_the_references():
    scores, k, want = crafted_tie()
    pos, counts = select_topk_reference(scores, k)
    assert pos.tolist() == [want] and counts.tolist() == [k]
    visible = torch.tensor([scores.shape[1]])
    assert select_topk(scores, visible, k).tolist() == [want]  # the engine's selection
    # layer 20's blocks of 2 (9 entries visible): maxima [3, 2, 9, 2, +inf (newest, pinned)]; the 4th kept
    # block is one of the two 2.0 blocks, the lower one (1)
    blocks, counts, _ = candidate_blocks_reference(scores, torch.tensor([9]), 2, 4)
    assert blocks.tolist() == [[0, 1, 2, 4]] and counts.tolist() == [4]
    allowed = candidate_pool(scores, torch.tensor([9]), 2, 4)  # the engine's pool
    assert allowed.nonzero()[:, 1].tolist() == [0, 1, 2, 3, 4, 5, 8]


def test_the_tie_test_catches_a_higher_index_rule():
    scores, k, want = crafted_tie()
    flipped = torch.flip(scores, dims=[1])  # a "higher index wins" rule is the same rule on reversed scores
    n = scores.shape[1]
    other = sorted(n - 1 - int(i) for i in select_topk_reference(flipped, k)[0][0])
    assert other != want


def official_topk(scores: torch.Tensor, k: int) -> torch.Tensor:
    """The official call (V4.1 ``Indexer.forward``), on whatever device ``scores`` is on."""
    return scores.topk(k, dim=-1, sorted=False).indices.sort(dim=-1).values


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("length, rows", [(10, 1), (4096, 8), (30_000, 4), (200_000, 2)],
                         ids=["crafted", "single-block", "multi-block", "sort-path"])
def test_cuda_topk_breaks_ties_like_the_reference(length, rows):
    g = torch.Generator().manual_seed(length)
    if length == 10:
        scores, k, _ = crafted_tie()
    else:  # few distinct values: every cut falls inside a long run of ties
        scores, k = torch.randint(0, 7, (rows, length), generator=g).float() * 0.5, 512
    ref, _ = select_topk_reference(scores, k)
    assert torch.equal(official_topk(scores.cuda(), k).cpu(), ref)


@pytest.mark.gpu
@needs_cuda
def test_cuda_topk_ranks_positive_zero_above_negative_zero():
    """The one order that differs from ours (see the module docstring): documented, never reached by the model."""
    scores = torch.tensor([[-0.0, -0.0, 0.0, 1.0]])
    assert official_topk(scores.cuda(), 2).cpu().tolist() == [[2, 3]]
    assert select_topk_reference(scores, 2)[0].tolist() == [[0, 3]]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="needs compiled Triton (TRITON_INTERPRET=0)")
@pytest.mark.parametrize("quantize", [quantize_fp4, quantize_mxfp4], ids=["fp4", "mxfp4"])
def test_compiled_triton_writes_code_8(quantize):
    x, codes = zero_block()
    assert nibbles(quantize(x.cuda(), impl="triton")[0].cpu()) == codes
