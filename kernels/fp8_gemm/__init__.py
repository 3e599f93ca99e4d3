"""FP8 (E4M3, 128x128 block scales) GEMM: ``op``, ``reference``, Triton ``kernel``.
"""

# The modules the rest of flashtier may import (tests/test_layering.py); the others are this package's own.
__all__ = ["kernel", "op"]
