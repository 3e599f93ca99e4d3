"""Sampling: ``SamplingParams``, the batched ``Sampler`` (penalties, top-k/top-p/min-p, grammar masks,
seeded draws) and the logprob output.
"""

# The modules the rest of flashtier may import (tests/test_layering.py); the others are this package's own.
__all__ = ["params", "processors", "row", "sampler"]
