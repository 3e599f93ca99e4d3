"""Manifold hyper-connections: the mixing coefficients (``coeffs`` with its reference and kernel) and the
stream ops (``streams``).
"""

# The modules the rest of flashtier may import (tests/test_layering.py); the others are this package's own.
__all__ = ["coeffs", "streams"]
