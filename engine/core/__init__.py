"""The engine's shared data model: ``Request`` / ``Sequence`` and their state machine, the schedule -> execute
seam (``SchedulerOutput``) and what the engine returns (``outputs``).
"""

# The modules the rest of flashtier may import (tests/test_layering.py); the others are this package's own.
__all__ = ["outputs", "request", "request_state", "scheduler_output"]
