"""Batch-invariant row reductions: ``op`` and its Triton ``kernel``.
"""

# The modules the rest of flashtier may import (tests/test_layering.py); the others are this package's own.
__all__ = ["kernel", "op"]
