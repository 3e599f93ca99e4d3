"""Execute: ``ModelRunner`` runs a ``SchedulerOutput`` through the paged forward, with the decode step's
row layout, step metadata and CUDA graphs.
"""

# The modules the rest of flashtier may import (tests/test_layering.py); the others are this package's own.
__all__ = ["decode_graphs", "decode_step", "paged_runner", "runner"]
