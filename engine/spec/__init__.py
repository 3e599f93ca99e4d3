"""Speculative decoding with the DSpark drafter: drafting, scheduling draft rows, verification and
acceptance, the acceptance statistics, and the goodput controller that picks each step's draft length.
"""

# The modules the rest of flashtier may import (tests/test_layering.py); the others are this package's own.
__all__ = ["controller", "draft_graphs", "drafter", "schedule", "state", "stats", "verify"]
