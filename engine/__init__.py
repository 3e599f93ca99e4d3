"""The engine: ``Engine.step()`` (schedule -> execute -> postprocess), the scheduler, the async engine the server
talks to (``client``), the factory that builds either from settings, and the subpackages below.
"""

# The modules the rest of flashtier may import (tests/test_layering.py); the others are this package's own.
__all__ = ["client", "config", "engine", "engine_stats", "factory", "generate", "warmup"]
