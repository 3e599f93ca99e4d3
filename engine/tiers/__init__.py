"""The SSD and snapshot tiers as the engine sees them: ``TierManager`` (lookups, write-through, snapshots on
its own I/O thread), the scheduler's ``TierClient``, the restore buffer, snapshot encoding and resume planning.
"""

# The modules the rest of flashtier may import (tests/test_layering.py); the others are this package's own.
__all__ = ["client", "manager", "resume"]
