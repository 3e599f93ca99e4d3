"""The kernels whose integer arguments follow the batch keep them unspecialised (their ``*_COUNTS`` tuples).

Triton accepts any name in ``do_not_specialize`` and silently ignores one that is not a parameter, so a renamed
argument would bring back a compile per batch shape on the request path (tests/engine/test_warmup_gpu.py
shows that on a GPU). Here, on the CPU: every name is a parameter of its kernel and the kernel was built with
exactly that tuple.
"""

import inspect

import pytest

from flashtier.kernels.fp8_gemm import kernel as fp8
from flashtier.kernels.indexer_topk import kernel as indexer
from flashtier.kernels.invariant_linear import kernel as linear
from flashtier.kernels.moe import align_kernel as align
from flashtier.kernels.moe import grouped_gemm_kernel as moe
from flashtier.kernels.moe import splitk_reduce_kernel as splitk
from flashtier.kernels.quant import fp8_weight

KERNELS = {
    "moe_align": (align._moe_align_kernel, align.BATCH_COUNTS),
    "moe_gemm": (moe._moe_gemm_kernel, moe.BATCH_COUNTS),
    "moe_splitk_reduce": (splitk._moe_splitk_reduce_kernel, splitk.BATCH_COUNTS),
    "fp8_gemm": (fp8._fp8_gemm_kernel, fp8.BATCH_COUNTS),
    "fp8_split_reduce": (fp8._split_reduce_kernel, fp8.REDUCE_COUNTS),
    "invariant_linear": (linear._linear_kernel, linear.BATCH_COUNTS),
    "indexer_score": (indexer._score_kernel, indexer.SCORE_COUNTS),
    "indexer_count": (indexer._count_kernel, indexer.COUNT_COUNTS),
    "indexer_write": (indexer._write_kernel, indexer.WRITE_COUNTS),
    "fp8_weight_dequantize": (fp8_weight._dequantize_fp8_weight_kernel, fp8_weight.DEQUANT_COUNTS),  # Engram rows
}


def unspecialised(kernel) -> tuple[str, ...]:
    """The names a kernel was built not to specialise (compiled JITFunction or the interpreter's wrapper)."""
    if hasattr(kernel, "params"):
        return tuple(p.name for p in kernel.params if p.do_not_specialize)
    names = kernel.kwargs.get("do_not_specialize") or ()
    return tuple(n for n in inspect.signature(kernel.fn).parameters if n in names)


def check(kernel, counts: tuple[str, ...]) -> None:
    params = list(inspect.signature(kernel.fn).parameters)
    missing = [c for c in counts if c not in params]
    assert not missing, f"{missing} are not parameters of {kernel.fn.__name__}"
    assert set(unspecialised(kernel)) == set(counts), f"{kernel.fn.__name__}: built with another tuple"


@pytest.mark.parametrize("name", sorted(KERNELS))
def test_batch_counts_are_parameters_left_unspecialised(name):
    check(*KERNELS[name])


@pytest.mark.parametrize("counts", [("n_pairs", "n_tokens", "n_rblocks", "n_m", "m_lo", "m_hi"), ("n_pairs",)],
                         ids=["misspelt", "one-left-out"])
def test_the_check_fails_on_a_broken_tuple(counts):
    with pytest.raises(AssertionError):
        check(moe._moe_gemm_kernel, counts)
