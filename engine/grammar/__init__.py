"""Constrained decoding: grammars compiled with xgrammar, a request's grammar state and the token masks.
"""

# The modules the rest of flashtier may import (tests/test_layering.py); the others are this package's own.
__all__ = ["compiler", "constraint", "mask"]
