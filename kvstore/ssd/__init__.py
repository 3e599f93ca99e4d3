"""The SSD tier: an append-only segment log of checksummed block records with an in-memory index, the writer,
the reader, compaction, refresh of lifetimes, and the health counters (``store`` is its front door).
"""

# The modules the rest of flashtier may import (tests/test_layering.py); the others are this package's own.
__all__ = ["health", "index", "put_result", "record", "segment", "store", "tenant_delete", "writer"]
