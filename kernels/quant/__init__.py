"""Quantisation formats: FP8 E4M3 activations and weights, FP4 / MXFP4 (E2M1 with scales), their bit
layouts and the shared quantise/dequantise helpers.
"""

# The modules the rest of flashtier may import (tests/test_layering.py); the others are this package's own.
__all__ = ["common", "e2m1", "fp4", "fp8", "fp8_bits", "fp8_weight", "mxfp4"]
