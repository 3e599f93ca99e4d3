"""FP8 (E4M3, 32x32 block scales) GEMM: ``op``, ``reference``, Triton ``kernel``, the per-shape ``tuning`` tables.
"""

# The modules the rest of flashtier may import (tests/test_layering.py); the others are this package's own.
__all__ = ["kernel", "op", "tuning"]
