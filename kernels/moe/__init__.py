"""Mixture of experts: routing (``route``), token alignment by expert (``align``), the grouped GEMM over
MXFP4 experts (``grouped_gemm``, reference, kernels: tile, split-K reduce, combine) and the expert weights.
"""

# The modules the rest of flashtier may import (tests/test_layering.py); the others are this package's own.
__all__ = ["gemm_config", "grouped_gemm", "grouped_gemm_reference", "route", "weights"]
