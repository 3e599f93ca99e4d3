"""Encoder window snapshots: their keys (``key``) and the DRAM pools that hold them, embedded (``pool``)
or Redis (``redis_pool``); the embedded pool's file across a clean restart (``persist``).
"""

# The modules the rest of flashtier may import (tests/test_layering.py); the others are this package's own.
__all__ = ["key", "persist", "pool", "redis_pool"]
