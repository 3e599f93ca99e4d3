"""KV storage below the engine: block hashes, the block pool and its free queue, the KV byte layout and
configuration, and the SSD and snapshot tiers in the subpackages.
"""

# The modules the rest of flashtier may import (tests/test_layering.py); the others are this package's own.
__all__ = ["block_hash", "block_pool", "circuit_breaker", "config", "kv_pool", "layout", "redis_url", "tenant"]
