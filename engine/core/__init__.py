"""The engine's shared data model: ``Request`` / ``Sequence`` and their state machine, the schedule -> execute
seam (``SchedulerOutput``) and what the engine returns (``outputs``, built by ``output_builder``); the request-level operations on them:
forking ``n`` choices (``fork``) and swapping a preempted sequence out and in (``preemption``).
"""

# The modules the rest of flashtier may import (tests/test_layering.py); the others are this package's own.
__all__ = ["fork", "output_builder", "outputs", "preemption", "request", "request_state", "scheduler_output"]
