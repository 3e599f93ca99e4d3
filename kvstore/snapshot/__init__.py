"""Encoder window snapshots: their keys (``key``) and the DRAM pools that hold them, embedded (``pool``)
or Redis (``redis_pool``).
"""

# The modules the rest of flashtier may import (tests/test_layering.py); the others are this package's own.
__all__ = ["key", "pool", "redis_pool"]
