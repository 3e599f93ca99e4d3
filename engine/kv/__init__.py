"""The paged KV cache of running sequences: ``KVManager`` over the block pool, paged sequences, window rings,
the KV accounting of a geometry, and speculative rollback of a sequence's KV.
"""

# The modules the rest of flashtier may import (tests/test_layering.py); the others are this package's own.
__all__ = ["accounting", "manager", "paged_kv", "rollback", "window_rings"]
