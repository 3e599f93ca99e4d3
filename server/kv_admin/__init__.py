"""``flashtier kv``: the SSD tier's offline commands (stats, verify, wipe), their output format and the lock
that keeps them off a directory a server holds.
"""

# The modules the rest of flashtier may import (tests/test_layering.py); the others are this package's own.
__all__ = ["command"]
