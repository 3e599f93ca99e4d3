"""Batch-invariant linear layers (the result of a row never depends on the batch): ``op``, Triton ``kernel``.
"""

# The modules the rest of flashtier may import (tests/test_layering.py); the others are this package's own.
__all__ = ["op"]
