"""The sparse attention indexer's score and top-k: ``op``, ``reference``, Triton ``kernel``.
"""

# The modules the rest of flashtier may import (tests/test_layering.py); the others are this package's own.
__all__ = ["op"]
