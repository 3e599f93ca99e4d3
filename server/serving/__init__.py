"""What every API's routes share: ``ServerState``, request checks, ``EngineStream`` (one engine request),
the generation loop that renders outputs as SSE or one JSON body, the shutdown drain, and the Prometheus metrics.
"""

# The modules the rest of flashtier may import (tests/test_layering.py); the others are this package's own.
__all__ = ["drain", "engine_stream", "generation", "metrics", "request_checks", "state"]
