"""Speculative decoding with the DSpark drafter: drafting, scheduling draft rows, verification and
acceptance, and the acceptance statistics.
"""

# The modules the rest of flashtier may import (tests/test_layering.py); the others are this package's own.
__all__ = ["drafter", "schedule", "state", "stats", "verify"]
