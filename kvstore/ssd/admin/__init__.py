"""Offline inspection and repair of an SSD directory: scan, report, verify, wipe, and the admin lock.
"""

# The modules the rest of flashtier may import (tests/test_layering.py); the others are this package's own.
__all__ = ["lock", "report", "scan", "verify", "wipe"]
