"""flashtier.kernels."""
