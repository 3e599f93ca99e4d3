"""The stored conversations behind the Responses API's ``previous_response_id``: in memory, on disk or
in Redis (``store`` opens the one the settings name).
"""

# The modules the rest of flashtier may import (tests/test_layering.py); the others are this package's own.
__all__ = ["owner", "store"]
