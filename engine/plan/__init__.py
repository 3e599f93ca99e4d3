"""The memory plan: what a model and its serving settings take per GPU and per host, computed before loading.

``inventory`` lists a checkpoint's logical tensors (from a preset's geometry or from the shard headers alone),
``memory_plan`` places them on ranks as the engine does (formats, tensor / expert parallel slices, the Engram
tables in host memory) and adds the KV pool, CUDA graphs, activations and host buffers; ``report`` prints it.
"""

# The modules the rest of flashtier may import (tests/test_layering.py); the others are this package's own.
__all__ = ["inventory", "memory_plan", "report"]
